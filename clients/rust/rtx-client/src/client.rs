//! The async client, on Tokio.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::{Instant, Sleep};

use crate::error::{ApiError, Error};
use crate::options::{header_value, json_body, Config, RequestOptions, LAST_EVENT_ID};
use crate::retry::RetryPolicy;
use crate::stream::{EventDecoder, StreamCursor, StreamEvent};
use crate::types::{
    ChatChunk, ChatCompletion, ChatRequest, Completion, CompletionRequest, EmbedRequest, EmbedResponse,
    EmbeddingsRequest, EmbeddingsResponse, GenerateEvent, GenerateRequest, Generation, ModelList, StreamCancellation,
};

/// Settings of a [`Client`] (and of a [`blocking::Client`](crate::blocking::Client)).
#[derive(Debug)]
pub struct ClientBuilder {
    config: Result<Config, Error>,
}

impl ClientBuilder {
    pub(crate) fn new(base_url: &str) -> ClientBuilder {
        ClientBuilder { config: Config::new(base_url) }
    }

    /// Sent as `Authorization: Bearer KEY` on every request.
    pub fn api_key(mut self, api_key: impl Into<String>) -> ClientBuilder {
        if let Ok(config) = &mut self.config {
            config.api_key = Some(api_key.into());
        }
        self
    }

    /// The lane of requests that name none (`x-rtx-lane`).
    pub fn lane(mut self, lane: impl Into<String>) -> ClientBuilder {
        if let Ok(config) = &mut self.config {
            config.lane = Some(lane.into());
        }
        self
    }

    /// Bounds connecting, the wait for an answer, and each wait between two events of a stream (default 60 s);
    /// a stream may run longer as long as events keep coming.
    pub fn timeout(mut self, timeout: Duration) -> ClientBuilder {
        if let Ok(config) = &mut self.config {
            config.timeout = timeout;
        }
        self
    }

    /// How refused requests are retried (default: [`RetryPolicy::default`], three attempts).
    pub fn retry(mut self, retry: RetryPolicy) -> ClientBuilder {
        if let Ok(config) = &mut self.config {
            config.retry = retry;
        }
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        let config = self.config?;
        let http = reqwest::Client::builder()
            .connect_timeout(config.timeout)
            .user_agent(user_agent())
            .build()
            .map_err(Error::from_transport)?;
        Ok(Client { http, config: Arc::new(config) })
    }

    pub(crate) fn into_config(self) -> Result<Config, Error> {
        self.config
    }
}

pub(crate) fn user_agent() -> String {
    format!("rtx-client-rust/{}", env!("CARGO_PKG_VERSION"))
}

/// Async client of rtx-serve's HTTP API; cheap to clone (clones share their connections).
///
/// Streaming methods return an [`EventStream`] once the server has accepted the request; dropping it closes the
/// connection, and the server aborts the request (unless it keeps a journal: then the request runs on and
/// [`Client::resume`] picks it up).
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    config: Arc<Config>,
}

impl Client {
    /// A client of the server at `base_url` (`http://127.0.0.1:8000`) with default settings.
    pub fn new(base_url: &str) -> Result<Client, Error> {
        Client::builder(base_url).build()
    }

    pub fn builder(base_url: &str) -> ClientBuilder {
        ClientBuilder::new(base_url)
    }

    // -- OpenAI-compatible routes ---------------------------------------------------------------------------------

    pub async fn chat(&self, request: &ChatRequest) -> Result<ChatCompletion, Error> {
        self.call(Method::POST, &["v1", "chat", "completions"], Some(request), &request.options).await
    }

    pub async fn stream_chat(&self, request: &ChatRequest) -> Result<EventStream<ChatChunk>, Error> {
        self.stream(&["v1", "chat", "completions"], &Streaming::new(request), &request.options).await
    }

    pub async fn completions(&self, request: &CompletionRequest) -> Result<Completion, Error> {
        self.call(Method::POST, &["v1", "completions"], Some(request), &request.options).await
    }

    pub async fn stream_completions(&self, request: &CompletionRequest) -> Result<EventStream<Completion>, Error> {
        self.stream(&["v1", "completions"], &Streaming::new(request), &request.options).await
    }

    pub async fn embeddings(&self, request: &EmbeddingsRequest) -> Result<EmbeddingsResponse, Error> {
        self.call(Method::POST, &["v1", "embeddings"], Some(request), &request.options).await
    }

    pub async fn models(&self) -> Result<ModelList, Error> {
        self.call::<(), _>(Method::GET, &["v1", "models"], None, &RequestOptions::default()).await
    }

    // -- native routes --------------------------------------------------------------------------------------------

    /// The native `/generate`, its whole result at once.
    pub async fn generate(&self, request: &GenerateRequest) -> Result<Generation, Error> {
        let body = Streaming { body: request, stream: false };
        self.call(Method::POST, &["generate"], Some(&body), &request.options).await
    }

    /// The native `/generate`, one event per engine step.
    pub async fn stream_generate(&self, request: &GenerateRequest) -> Result<EventStream<GenerateEvent>, Error> {
        self.stream(&["generate"], &Streaming::new(request), &request.options).await
    }

    pub async fn embed(&self, request: &EmbedRequest) -> Result<EmbedResponse, Error> {
        self.call(Method::POST, &["embed"], Some(request), &request.options).await
    }

    // -- resumable streams ----------------------------------------------------------------------------------------

    /// The events of a journaled stream after `cursor` (`GET /v1/streams/{id}` with `Last-Event-ID`): those it
    /// missed, replayed, then live ones until its end. `T` is the type of the stream's events (`ChatChunk` for a
    /// chat, `Completion`, `GenerateEvent`).
    pub async fn resume<T: StreamEvent>(
        &self,
        cursor: &StreamCursor,
        options: &RequestOptions,
    ) -> Result<EventStream<T>, Error> {
        let url = self.config.url(&["v1", "streams", &cursor.request_id]);
        let mut headers = self.config.headers(options)?;
        headers.insert(LAST_EVENT_ID, header_value(LAST_EVENT_ID, &cursor.last_event_id.to_string())?);
        let timeout = self.config.timeout(options);
        let response = self
            .send(self.config.retry(options), || {
                let request = self.http.get(url.clone()).headers(headers.clone());
                with_timeout(timeout, request.send())
            })
            .await?;
        Ok(EventStream::new(response, cursor.last_event_id, timeout))
    }

    /// Stops a journaled request (`DELETE /v1/streams/{id}`), which dropping its stream does not: each choice still
    /// running finishes with `finish_reason` `"abort"`, and its streams end with that event. Only `cursor`'s
    /// `request_id` is read.
    pub async fn cancel(&self, cursor: &StreamCursor, options: &RequestOptions) -> Result<StreamCancellation, Error> {
        self.call::<(), _>(Method::DELETE, &["v1", "streams", &cursor.request_id], None, options).await
    }

    // -- transport ------------------------------------------------------------------------------------------------

    async fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        route: &[&str],
        body: Option<&B>,
        options: &RequestOptions,
    ) -> Result<T, Error> {
        let url = self.config.url(route);
        let headers = self.config.headers(options)?;
        let timeout = self.config.timeout(options);
        let body = body.map(json_body).transpose()?;
        let response = self
            .send(self.config.retry(options), || {
                let mut request = self.http.request(method.clone(), url.clone()).headers(headers.clone());
                if let Some(body) = &body {
                    request = request.header(CONTENT_TYPE, "application/json").body(body.clone());
                }
                let request = request.timeout(timeout);
                async move { request.send().await.map_err(Error::from_transport) }
            })
            .await?;
        let bytes = response.bytes().await.map_err(Error::from_transport)?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Decode(format!("the answer to {}: {e}", route.join("/"))))
    }

    async fn stream<B: Serialize, T: StreamEvent>(
        &self,
        route: &[&str],
        body: &B,
        options: &RequestOptions,
    ) -> Result<EventStream<T>, Error> {
        let url = self.config.url(route);
        let headers = self.config.headers(options)?;
        let timeout = self.config.timeout(options);
        let body = json_body(body)?;
        let response = self
            .send(self.config.retry(options), || {
                let request = self.http.post(url.clone()).headers(headers.clone());
                let request = request.header(CONTENT_TYPE, "application/json").body(body.clone());
                with_timeout(timeout, request.send())
            })
            .await?;
        Ok(EventStream::new(response, 0, timeout))
    }

    /// Sends a request (made anew by `attempt` each time) until it is accepted, or refused for good.
    async fn send<F, Fut>(&self, policy: &RetryPolicy, attempt: F) -> Result<Response, Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Response, Error>>,
    {
        let mut num_attempts = 1;
        loop {
            let response = attempt().await?;
            if response.status().is_success() {
                return Ok(response);
            }
            let (status, headers) = (response.status(), response.headers().clone());
            let body = response.bytes().await.map_err(Error::from_transport)?;
            let error = Error::from(ApiError::from_response(status, &headers, &body));
            match policy.delay(num_attempts, &error) {
                Some(delay) => tokio::time::sleep(delay).await,
                None => return Err(error),
            }
            num_attempts += 1;
        }
    }
}

/// `send()` bounded by `timeout` until the answer's headers come; the body is not bounded (a stream bounds the
/// wait for each of its events itself).
async fn with_timeout(
    timeout: Duration,
    send: impl Future<Output = reqwest::Result<Response>>,
) -> Result<Response, Error> {
    match tokio::time::timeout(timeout, send).await {
        Ok(result) => result.map_err(Error::from_transport),
        Err(_) => Err(Error::Timeout(format!("no answer within {timeout:?}"))),
    }
}

/// A request body with `"stream"` set.
#[derive(Serialize)]
pub(crate) struct Streaming<'a, B> {
    #[serde(flatten)]
    pub body: &'a B,
    pub stream: bool,
}

impl<'a, B> Streaming<'a, B> {
    pub fn new(body: &'a B) -> Streaming<'a, B> {
        Streaming { body, stream: true }
    }
}

type Body = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// The events of a streaming response, typed, as a [`Stream`] (read it with [`StreamExt::next`]); `None` after
/// the stream's last event. A stream cut before its end yields [`Error::Connection`], and its
/// [`EventStream::cursor`] resumes it.
///
/// [`StreamExt::next`]: crate::StreamExt::next
pub struct EventStream<T> {
    body: Body,
    events: EventDecoder<T>,
    idle: Pin<Box<Sleep>>,
    timeout: Duration,
}

impl<T: StreamEvent> EventStream<T> {
    fn new(response: Response, after: u64, timeout: Duration) -> EventStream<T> {
        let events = EventDecoder::new(response.headers(), after);
        EventStream {
            body: Box::pin(response.bytes_stream()),
            events,
            idle: Box::pin(tokio::time::sleep(timeout)),
            timeout,
        }
    }

    /// The server's id of the request (`x-rtx-request-id`), which [`Client::resume`] takes.
    pub fn request_id(&self) -> Option<&str> {
        self.events.request_id()
    }

    /// The id of the last event received (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.events.last_event_id()
    }

    /// Where the stream stands, to resume it after a cut; `None` when the server did not name the request.
    pub fn cursor(&self) -> Option<StreamCursor> {
        self.events.cursor()
    }

    /// The server's `traceparent`: the caller's trace (or a new one), with the server's span as the parent.
    pub fn traceparent(&self) -> Option<&str> {
        self.events.traceparent()
    }

    /// Whether the stream's last event came.
    pub fn is_finished(&self) -> bool {
        self.events.is_finished()
    }
}

impl<T: StreamEvent> Stream for EventStream<T> {
    type Item = Result<T, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(item) = this.events.next_item() {
                return Poll::Ready(Some(item));
            }
            if this.events.is_done() {
                return Poll::Ready(None);
            }
            match this.body.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    this.events.feed(&chunk);
                    this.idle.as_mut().reset(Instant::now() + this.timeout);
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(this.events.fail(Error::from_transport(e))))),
                Poll::Ready(None) => {
                    if let Some(error) = this.events.end_of_body() {
                        return Poll::Ready(Some(Err(error)));
                    }
                }
                Poll::Pending => {
                    if this.idle.as_mut().poll(cx).is_ready() {
                        let error = Error::Timeout(format!("no event for {:?}", this.timeout));
                        return Poll::Ready(Some(Err(this.events.fail(error))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl<T> std::fmt::Debug for EventStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("request_id", &self.events.request_id())
            .field("last_event_id", &self.events.last_event_id())
            .finish_non_exhaustive()
    }
}
