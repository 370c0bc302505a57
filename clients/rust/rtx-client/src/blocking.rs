//! The blocking client: the same methods as the async [`Client`](crate::Client), for code without an async
//! runtime (it must not be used inside one: reqwest's blocking client runs its own).

use std::io::Read;
use std::sync::Arc;

use reqwest::blocking::Response;
use reqwest::header::CONTENT_TYPE;
use reqwest::Method;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::client::{user_agent, ClientBuilder, Streaming};
use crate::error::{ApiError, Error};
use crate::options::{header_value, json_body, Config, RequestOptions, LAST_EVENT_ID};
use crate::retry::RetryPolicy;
use crate::stream::{EventDecoder, StreamCursor, StreamEvent};
use crate::types::{
    ChatChunk, ChatCompletion, ChatRequest, Completion, CompletionRequest, EmbedRequest, EmbedResponse,
    EmbeddingsRequest, EmbeddingsResponse, GenerateEvent, GenerateRequest, Generation, ModelList, StreamCancellation,
};

/// Blocking client of rtx-serve's HTTP API; cheap to clone. Streaming methods return an [`Events`] iterator;
/// dropping it closes the connection, and the server aborts the request (unless it keeps a journal).
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::blocking::Client,
    config: Arc<Config>,
}

impl ClientBuilder {
    /// A blocking client with these settings.
    pub fn build_blocking(self) -> Result<Client, Error> {
        let config = self.into_config()?;
        // reqwest's blocking timeout bounds the wait for the answer and then each read of the body: a stream's
        // wait for each event, as for the async client.
        let http = reqwest::blocking::Client::builder()
            .connect_timeout(config.timeout)
            .timeout(config.timeout)
            .user_agent(user_agent())
            .build()
            .map_err(Error::from_transport)?;
        Ok(Client { http, config: Arc::new(config) })
    }
}

impl Client {
    pub fn new(base_url: &str) -> Result<Client, Error> {
        ClientBuilder::new(base_url).build_blocking()
    }

    /// Settings as for the async client; finish with [`ClientBuilder::build_blocking`].
    pub fn builder(base_url: &str) -> ClientBuilder {
        ClientBuilder::new(base_url)
    }

    pub fn chat(&self, request: &ChatRequest) -> Result<ChatCompletion, Error> {
        self.call(Method::POST, &["v1", "chat", "completions"], Some(request), &request.options)
    }

    pub fn stream_chat(&self, request: &ChatRequest) -> Result<Events<ChatChunk>, Error> {
        self.stream(&["v1", "chat", "completions"], &Streaming::new(request), &request.options)
    }

    pub fn completions(&self, request: &CompletionRequest) -> Result<Completion, Error> {
        self.call(Method::POST, &["v1", "completions"], Some(request), &request.options)
    }

    pub fn stream_completions(&self, request: &CompletionRequest) -> Result<Events<Completion>, Error> {
        self.stream(&["v1", "completions"], &Streaming::new(request), &request.options)
    }

    pub fn embeddings(&self, request: &EmbeddingsRequest) -> Result<EmbeddingsResponse, Error> {
        self.call(Method::POST, &["v1", "embeddings"], Some(request), &request.options)
    }

    pub fn models(&self) -> Result<ModelList, Error> {
        self.call::<(), _>(Method::GET, &["v1", "models"], None, &RequestOptions::default())
    }

    pub fn generate(&self, request: &GenerateRequest) -> Result<Generation, Error> {
        let body = Streaming { body: request, stream: false };
        self.call(Method::POST, &["generate"], Some(&body), &request.options)
    }

    pub fn stream_generate(&self, request: &GenerateRequest) -> Result<Events<GenerateEvent>, Error> {
        self.stream(&["generate"], &Streaming::new(request), &request.options)
    }

    pub fn embed(&self, request: &EmbedRequest) -> Result<EmbedResponse, Error> {
        self.call(Method::POST, &["embed"], Some(request), &request.options)
    }

    /// The events of a journaled stream after `cursor`, as [`Client::resume`](crate::Client::resume).
    pub fn resume<T: StreamEvent>(&self, cursor: &StreamCursor, options: &RequestOptions) -> Result<Events<T>, Error> {
        let url = self.config.url(&["v1", "streams", &cursor.request_id]);
        let mut headers = self.config.headers(options)?;
        headers.insert(LAST_EVENT_ID, header_value(LAST_EVENT_ID, &cursor.last_event_id.to_string())?);
        let timeout = options.timeout_override();
        let response = self.send(self.config.retry(options), || {
            let mut request = self.http.get(url.clone()).headers(headers.clone());
            if let Some(timeout) = timeout {
                request = request.timeout(timeout);
            }
            request.send().map_err(Error::from_transport)
        })?;
        Ok(Events::new(response, cursor.last_event_id))
    }

    /// Stops a journaled request, as [`Client::cancel`](crate::Client::cancel).
    pub fn cancel(&self, cursor: &StreamCursor, options: &RequestOptions) -> Result<StreamCancellation, Error> {
        self.call::<(), _>(Method::DELETE, &["v1", "streams", &cursor.request_id], None, options)
    }

    fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
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
        let response = self.send(self.config.retry(options), || {
            let mut request = self.http.request(method.clone(), url.clone()).headers(headers.clone());
            if let Some(body) = &body {
                request = request.header(CONTENT_TYPE, "application/json").body(body.clone());
            }
            request.timeout(timeout).send().map_err(Error::from_transport)
        })?;
        let bytes = response.bytes().map_err(Error::from_transport)?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Decode(format!("the answer to {}: {e}", route.join("/"))))
    }

    fn stream<B: Serialize, T: StreamEvent>(
        &self,
        route: &[&str],
        body: &B,
        options: &RequestOptions,
    ) -> Result<Events<T>, Error> {
        let url = self.config.url(route);
        let headers = self.config.headers(options)?;
        // The client's timeout bounds each read; a request's own bounds the whole stream (reqwest's blocking
        // client has no other way).
        let timeout = options.timeout_override();
        let body = json_body(body)?;
        let response = self.send(self.config.retry(options), || {
            let mut request = self.http.post(url.clone()).headers(headers.clone());
            request = request.header(CONTENT_TYPE, "application/json").body(body.clone());
            if let Some(timeout) = timeout {
                request = request.timeout(timeout);
            }
            request.send().map_err(Error::from_transport)
        })?;
        Ok(Events::new(response, 0))
    }

    fn send(&self, policy: &RetryPolicy, attempt: impl Fn() -> Result<Response, Error>) -> Result<Response, Error> {
        let mut num_attempts = 1;
        loop {
            let response = attempt()?;
            if response.status().is_success() {
                return Ok(response);
            }
            let (status, headers) = (response.status(), response.headers().clone());
            let body = response.bytes().map_err(Error::from_transport)?;
            let error = Error::from(ApiError::from_response(status, &headers, &body));
            match policy.delay(num_attempts, &error) {
                Some(delay) => std::thread::sleep(delay),
                None => return Err(error),
            }
            num_attempts += 1;
        }
    }
}

/// The events of a streaming response, typed, as an iterator; it ends after the stream's last event. A stream cut
/// before its end yields [`Error::Connection`], and its [`Events::cursor`] resumes it.
pub struct Events<T> {
    response: Response,
    events: EventDecoder<T>,
    buffer: Box<[u8]>,
}

impl<T: StreamEvent> Events<T> {
    fn new(response: Response, after: u64) -> Events<T> {
        let events = EventDecoder::new(response.headers(), after);
        Events { response, events, buffer: vec![0; 16 * 1024].into_boxed_slice() }
    }

    /// The server's id of the request (`x-rtx-request-id`).
    pub fn request_id(&self) -> Option<&str> {
        self.events.request_id()
    }

    /// The id of the last event received (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.events.last_event_id()
    }

    /// Where the stream stands, to resume it after a cut.
    pub fn cursor(&self) -> Option<StreamCursor> {
        self.events.cursor()
    }

    /// The server's `traceparent`.
    pub fn traceparent(&self) -> Option<&str> {
        self.events.traceparent()
    }

    pub fn is_finished(&self) -> bool {
        self.events.is_finished()
    }
}

impl<T: StreamEvent> Iterator for Events<T> {
    type Item = Result<T, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(item) = self.events.next_item() {
                return Some(item);
            }
            if self.events.is_done() {
                return None;
            }
            match self.response.read(&mut self.buffer) {
                Ok(0) => {
                    if let Some(error) = self.events.end_of_body() {
                        return Some(Err(error));
                    }
                }
                Ok(n) => self.events.feed(&self.buffer[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Some(Err(self.events.fail(Error::from_io(e)))),
            }
        }
    }
}

impl<T> std::fmt::Debug for Events<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("request_id", &self.events.request_id())
            .field("last_event_id", &self.events.last_event_id())
            .finish_non_exhaustive()
    }
}
