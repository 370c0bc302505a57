//! The one error type of the client: what the server refused, and what went wrong on the way to it.

use std::fmt;
use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::StatusCode;
use serde::Deserialize;

use crate::retry::parse_retry_after;

/// Why a call failed.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// The server refused or failed the request: an error status, or an error event ending a stream.
    Api(Box<ApiError>),
    /// No answer (or, in a stream, no next event) within the timeout.
    Timeout(String),
    /// The server could not be reached, or the connection broke (a stream cut before its end is one).
    Connection(String),
    /// The server answered something this client cannot read (not the JSON the API describes).
    Decode(String),
    /// The call could not be made as asked: a header value that is not ASCII, a base URL that is not one.
    InvalidInput(String),
}

/// What the server's status (or, inside a stream, its error `type`) says went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// 400, 413, 422: the request is wrong; [`ApiError::param`] names the field when the server did.
    InvalidRequest,
    /// 401: no API key, or not a valid one.
    Unauthenticated,
    /// 403: the key may not do this (a lane its tenant is not entitled to, say).
    PermissionDenied,
    /// 404: no such model, route or resumable stream.
    NotFound,
    /// 429: over a rate limit or the server's capacity; retried after `Retry-After`.
    RateLimited,
    /// 503: the server is not ready or is stopping; retried after `Retry-After`.
    Unavailable,
    /// 504: the server's own deadline for the request passed.
    DeadlineExceeded,
    /// 500: a failure inside the server.
    Internal,
    /// Any other status.
    Other,
}

/// An error answered by the server, in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ApiError {
    pub kind: ErrorKind,
    /// The HTTP status; `None` for an error event inside a stream that had started.
    pub status: Option<u16>,
    /// The server's reason (`rate_limited`, `invalid_api_key`, `invalid_value`...), when it gave one.
    pub code: Option<String>,
    /// OpenAI's error type (`invalid_request_error`, `rate_limit_error`...), when the server gave one.
    pub error_type: Option<String>,
    pub message: String,
    /// The offending request field or header, when the server named one.
    pub param: Option<String>,
    /// How long the server asked the client to wait before trying again (`Retry-After`).
    pub retry_after: Option<Duration>,
    /// The server's id of the request (`x-request-id`), for its logs.
    pub request_id: Option<String>,
}

impl Error {
    /// The server's error, when the server answered one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            Error::Api(error) => Some(error),
            _ => None,
        }
    }

    /// Whether the answer means "try again later" (429 or 503); only those are retried.
    pub fn is_retryable(&self) -> bool {
        matches!(self.api(), Some(e) if matches!(e.kind, ErrorKind::RateLimited | ErrorKind::Unavailable))
    }

    pub(crate) fn from_transport(error: reqwest::Error) -> Error {
        let message = chain(&error);
        if error.is_timeout() {
            Error::Timeout(message)
        } else if error.is_decode() {
            Error::Decode(message)
        } else if error.is_builder() {
            Error::InvalidInput(message)
        } else {
            Error::Connection(message)
        }
    }

    /// An error reading a blocking response's body: reqwest reports its timeouts as `io::Error`s wrapping its own.
    pub(crate) fn from_io(error: std::io::Error) -> Error {
        if error.kind() == std::io::ErrorKind::TimedOut {
            return Error::Timeout(chain(&error));
        }
        match error.into_inner().map(|inner| inner.downcast::<reqwest::Error>()) {
            Some(Ok(inner)) => Error::from_transport(*inner),
            Some(Err(other)) => Error::Connection(chain(other.as_ref())),
            None => Error::Connection("the connection broke".to_owned()),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Api(error) => error.fmt(f),
            Error::Timeout(message) => write!(f, "timed out: {message}"),
            Error::Connection(message) => write!(f, "connection failed: {message}"),
            Error::Decode(message) => write!(f, "unreadable answer: {message}"),
            Error::InvalidInput(message) => write!(f, "invalid input: {message}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<ApiError> for Error {
    fn from(error: ApiError) -> Error {
        Error::Api(Box::new(error))
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.status {
            Some(status) => write!(f, "{status}")?,
            None => f.write_str("stream error")?,
        }
        if let Some(code) = &self.code {
            write!(f, " {code}")?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(param) = &self.param {
            write!(f, " (param: {param})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {}

/// The body of an error answer, or of an error event ending a stream.
#[derive(Deserialize)]
pub(crate) struct ErrorBody {
    error: ErrorFields,
}

#[derive(Deserialize)]
struct ErrorFields {
    #[serde(default)]
    message: Option<String>,
    #[serde(default, rename = "type")]
    error_type: Option<String>,
    #[serde(default)]
    param: Option<String>,
    #[serde(default)]
    code: Option<serde_json::Value>,
}

impl ApiError {
    /// The error a non-success answer stands for; a body not in OpenAI's shape becomes the message.
    pub(crate) fn from_response(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> ApiError {
        let retry_after =
            headers.get(reqwest::header::RETRY_AFTER).and_then(|value| value.to_str().ok()).and_then(parse_retry_after);
        let request_id = headers.get("x-request-id").and_then(|value| value.to_str().ok()).map(str::to_owned);
        let mut error = match serde_json::from_slice::<ErrorBody>(body) {
            Ok(parsed) => parsed.into_api_error(Some(status.as_u16())),
            Err(_) => {
                let text = String::from_utf8_lossy(body).trim().to_owned();
                let message = if text.is_empty() { format!("HTTP {status}") } else { text };
                ApiError::new(kind_of_status(status.as_u16()), Some(status.as_u16()), message)
            }
        };
        error.retry_after = retry_after;
        error.request_id = request_id;
        error
    }

    fn new(kind: ErrorKind, status: Option<u16>, message: String) -> ApiError {
        ApiError {
            kind,
            status,
            code: None,
            error_type: None,
            message,
            param: None,
            retry_after: None,
            request_id: None,
        }
    }
}

impl ErrorBody {
    pub(crate) fn into_api_error(self, status: Option<u16>) -> ApiError {
        let fields = self.error;
        let kind = fields
            .error_type
            .as_deref()
            .and_then(kind_of_type)
            .or_else(|| status.map(kind_of_status))
            .unwrap_or(ErrorKind::Other);
        let message = fields.message.unwrap_or_else(|| match status {
            Some(status) => format!("HTTP {status}"),
            None => "the stream ended with an error".to_owned(),
        });
        let code = fields.code.and_then(|code| match code {
            serde_json::Value::String(code) => Some(code),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        });
        ApiError { code, error_type: fields.error_type, param: fields.param, ..ApiError::new(kind, status, message) }
    }
}

fn kind_of_status(status: u16) -> ErrorKind {
    match status {
        400 | 413 | 422 => ErrorKind::InvalidRequest,
        401 => ErrorKind::Unauthenticated,
        403 => ErrorKind::PermissionDenied,
        404 => ErrorKind::NotFound,
        429 => ErrorKind::RateLimited,
        500 => ErrorKind::Internal,
        503 => ErrorKind::Unavailable,
        504 => ErrorKind::DeadlineExceeded,
        _ => ErrorKind::Other,
    }
}

/// The kind an OpenAI error type names (the server's types, `rtxcore.server.serving.formats`).
fn kind_of_type(error_type: &str) -> Option<ErrorKind> {
    Some(match error_type {
        "invalid_request_error" => ErrorKind::InvalidRequest,
        "authentication_error" => ErrorKind::Unauthenticated,
        "permission_error" => ErrorKind::PermissionDenied,
        "not_found_error" => ErrorKind::NotFound,
        "rate_limit_error" => ErrorKind::RateLimited,
        "service_unavailable_error" => ErrorKind::Unavailable,
        "timeout_error" => ErrorKind::DeadlineExceeded,
        "server_error" => ErrorKind::Internal,
        _ => return None,
    })
}

/// An error's message followed by those of its sources (reqwest's own says little: "error sending request").
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // hyper's and reqwest's messages often repeat their source's already: keep each text once.
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn an_openai_error_body_keeps_its_fields() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("2"));
        let body = br#"{"error": {"message": "over its limit", "type": "rate_limit_error", "param": null,
                        "code": "rate_limited"}}"#;
        let error = ApiError::from_response(StatusCode::TOO_MANY_REQUESTS, &headers, body);
        assert_eq!(error.kind, ErrorKind::RateLimited);
        assert_eq!((error.status, error.code.as_deref()), (Some(429), Some("rate_limited")));
        assert_eq!(error.message, "over its limit");
        assert_eq!(error.retry_after, Some(Duration::from_secs(2)));
        assert!(Error::from(error).is_retryable());
    }

    #[test]
    fn any_other_body_becomes_the_message() {
        let error = ApiError::from_response(StatusCode::BAD_GATEWAY, &HeaderMap::new(), b" upstream down \n");
        assert_eq!((error.kind, error.message.as_str()), (ErrorKind::Other, "upstream down"));
        let error = ApiError::from_response(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new(), b"");
        assert_eq!(error.message, "HTTP 503 Service Unavailable");
        assert!(Error::from(error).is_retryable());
    }

    #[test]
    fn a_stream_error_event_is_classified_by_its_type() {
        let body: ErrorBody =
            serde_json::from_str(r#"{"error": {"message": "too slow", "type": "timeout_error"}}"#).unwrap();
        let error = body.into_api_error(None);
        assert_eq!((error.kind, error.status), (ErrorKind::DeadlineExceeded, None));
        assert_eq!(error.to_string(), "stream error: too slow");
    }
}
