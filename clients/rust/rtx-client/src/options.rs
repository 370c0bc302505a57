//! What a call sends besides its body: the client's settings and each request's own options, as headers.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION};
use reqwest::Url;

use crate::error::Error;
use crate::retry::RetryPolicy;

/// The server's headers (`rtxcore/server/http`).
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";
pub(crate) const LANE: &str = "x-rtx-lane";
pub(crate) const REQUEST_ID: &str = "x-request-id";
pub(crate) const RTX_REQUEST_ID: &str = "x-rtx-request-id";
pub(crate) const TRACEPARENT: &str = "traceparent";
pub(crate) const TRACESTATE: &str = "tracestate";
pub(crate) const LAST_EVENT_ID: &str = "last-event-id";

pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Options of one request, sent as headers; set them on a request with its `options` method.
///
/// ```
/// use rtx_client::RequestOptions;
/// use std::time::Duration;
///
/// let options = RequestOptions::new()
///     .idempotency_key("order-1234")
///     .lane("realtime")
///     .traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
///     .timeout(Duration::from_secs(5));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOptions {
    idempotency_key: Option<String>,
    lane: Option<String>,
    request_id: Option<String>,
    traceparent: Option<String>,
    tracestate: Option<String>,
    timeout: Option<Duration>,
    retry: Option<RetryPolicy>,
}

impl RequestOptions {
    pub fn new() -> RequestOptions {
        RequestOptions::default()
    }

    /// `Idempotency-Key` (1-255 visible ASCII characters): sending a request again with the same key and body
    /// attaches to the first one (its response, or its stream from `Last-Event-ID`) instead of starting another.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> RequestOptions {
        self.idempotency_key = Some(key.into());
        self
    }

    /// The SLA lane the request runs in (`x-rtx-lane`: `realtime`, `standard`, `bulk`... as the server's
    /// `[lanes]` name them); overrides the client's default lane.
    pub fn lane(mut self, lane: impl Into<String>) -> RequestOptions {
        self.lane = Some(lane.into());
        self
    }

    /// `x-request-id`: the id the server logs the request under (and names OpenAI responses by).
    pub fn request_id(mut self, request_id: impl Into<String>) -> RequestOptions {
        self.request_id = Some(request_id.into());
        self
    }

    /// W3C `traceparent` of the caller's span: the server traces the request as its child.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> RequestOptions {
        self.traceparent = Some(traceparent.into());
        self
    }

    /// W3C `tracestate`, passed on with the trace.
    pub fn tracestate(mut self, tracestate: impl Into<String>) -> RequestOptions {
        self.tracestate = Some(tracestate.into());
        self
    }

    /// This request's timeout instead of the client's (see [`ClientBuilder::timeout`](crate::ClientBuilder::timeout)).
    /// One exception: for a stream of the [blocking client](crate::blocking::Client), it bounds the whole stream.
    pub fn timeout(mut self, timeout: Duration) -> RequestOptions {
        self.timeout = Some(timeout);
        self
    }

    /// This request's retry policy instead of the client's.
    pub fn retry(mut self, retry: RetryPolicy) -> RequestOptions {
        self.retry = Some(retry);
        self
    }
}

impl RequestOptions {
    pub(crate) fn timeout_override(&self) -> Option<Duration> {
        self.timeout
    }
}

/// A client's settings, shared by the async and the blocking client.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub base_url: Url,
    pub api_key: Option<String>,
    pub lane: Option<String>,
    pub timeout: Duration,
    pub retry: RetryPolicy,
}

impl Config {
    pub fn new(base_url: &str) -> Result<Config, Error> {
        // A base URL with a path (behind a proxy, say) keeps it: routes are joined onto it.
        let with_slash = if base_url.ends_with('/') { base_url.to_owned() } else { format!("{base_url}/") };
        let base_url =
            Url::parse(&with_slash).map_err(|e| Error::InvalidInput(format!("base URL {base_url:?}: {e}")))?;
        if base_url.cannot_be_a_base() {
            return Err(Error::InvalidInput(format!("base URL {base_url:?} cannot have routes")));
        }
        Ok(Config { base_url, api_key: None, lane: None, timeout: DEFAULT_TIMEOUT, retry: RetryPolicy::default() })
    }

    /// The URL of a route given as path segments (each one escaped as needed).
    pub fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base_url.clone();
        url.path_segments_mut().expect("checked in Config::new").pop_if_empty().extend(segments);
        url
    }

    pub fn timeout(&self, options: &RequestOptions) -> Duration {
        options.timeout.unwrap_or(self.timeout)
    }

    pub fn retry<'a>(&'a self, options: &'a RequestOptions) -> &'a RetryPolicy {
        options.retry.as_ref().unwrap_or(&self.retry)
    }

    /// The headers of a request with `options`.
    pub fn headers(&self, options: &RequestOptions) -> Result<HeaderMap, Error> {
        let mut headers = HeaderMap::new();
        if let Some(key) = &self.api_key {
            let mut value = header_value("API key", &format!("Bearer {key}"))?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let fields = [
            (IDEMPOTENCY_KEY, options.idempotency_key.as_ref()),
            (LANE, options.lane.as_ref().or(self.lane.as_ref())),
            (REQUEST_ID, options.request_id.as_ref()),
            (TRACEPARENT, options.traceparent.as_ref()),
            (TRACESTATE, options.tracestate.as_ref()),
        ];
        for (name, value) in fields {
            if let Some(value) = value {
                headers.insert(HeaderName::from_static(name), header_value(name, value)?);
            }
        }
        Ok(headers)
    }
}

pub(crate) fn header_value(what: &str, value: &str) -> Result<HeaderValue, Error> {
    HeaderValue::from_str(value).map_err(|_| Error::InvalidInput(format!("{what} is not a valid header value")))
}

/// A request's JSON body, or the reason it cannot be one (a NaN temperature, say): refused before anything is sent.
pub(crate) fn json_body<B: serde::Serialize + ?Sized>(body: &B) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(body).map_err(|e| Error::InvalidInput(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_join_onto_the_base_url() {
        let config = Config::new("http://127.0.0.1:8000").unwrap();
        assert_eq!(config.url(&["v1", "chat", "completions"]).as_str(), "http://127.0.0.1:8000/v1/chat/completions");
        let proxied = Config::new("https://example.com/rtx/").unwrap();
        assert_eq!(proxied.url(&["v1", "streams", "a/b c"]).as_str(), "https://example.com/rtx/v1/streams/a%2Fb%20c");
        assert!(matches!(Config::new("not a url"), Err(Error::InvalidInput(_))));
    }

    #[test]
    fn options_become_headers_and_a_request_lane_wins() {
        let mut config = Config::new("http://127.0.0.1:8000").unwrap();
        config.api_key = Some("sk-1".to_owned());
        config.lane = Some("bulk".to_owned());
        let headers = config.headers(&RequestOptions::new().idempotency_key("k-1")).unwrap();
        assert_eq!(headers["authorization"], "Bearer sk-1");
        assert!(headers["authorization"].is_sensitive());
        assert_eq!(
            (&headers["idempotency-key"], &headers["x-rtx-lane"]),
            (&"k-1".parse().unwrap(), &"bulk".parse().unwrap())
        );
        let headers = config.headers(&RequestOptions::new().lane("realtime")).unwrap();
        assert_eq!(headers["x-rtx-lane"], "realtime");
        let bad = config.headers(&RequestOptions::new().traceparent("caf\u{e9}\n"));
        assert!(matches!(bad, Err(Error::InvalidInput(message)) if message.contains("traceparent")));
    }
}
