//! What the async and the blocking streams share: turning SSE events into typed items, noticing the stream's end
//! (and a stream cut before it), and the cursor a cut stream resumes from.

use std::marker::PhantomData;

use reqwest::header::HeaderMap;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorBody};
use crate::options::{RTX_REQUEST_ID, TRACEPARENT};
use crate::sse::SseDecoder;

/// An item of a stream. OpenAI streams end with `data: [DONE]`; a native `/generate` stream with the event that
/// says it has `finished`.
pub trait StreamEvent: DeserializeOwned {
    /// Whether this is the stream's last event.
    fn is_last(&self) -> bool {
        false
    }
}

/// Where a stream stands: the server's id of its request and the last event received. A cut stream goes on
/// after that event with [`Client::resume`](crate::Client::resume), from the same server (or another one on the
/// same journal), with the same API key; the server must keep a journal (`rtx serve --state-dir`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamCursor {
    pub request_id: String,
    /// 0 before any event.
    pub last_event_id: u64,
}

/// The typed events of a response body, as its bytes come.
pub(crate) struct EventDecoder<T> {
    sse: SseDecoder,
    request_id: Option<String>,
    // x-request-id: the id of the server's logs, which an error event ending the stream carries as a refusal does.
    log_id: Option<String>,
    traceparent: Option<String>,
    last_event_id: u64,
    state: State,
    // fn() -> T: the decoder holds no T, so it is Send and Unpin whatever T is.
    item: PhantomData<fn() -> T>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    /// The stream's last event (or `[DONE]`) came: whatever follows is not read.
    Finished,
    /// An error was returned: the stream yields nothing more.
    Failed,
}

impl<T> EventDecoder<T> {
    /// A decoder for a response with these headers; `after` is the event the stream starts after.
    pub fn new(headers: &HeaderMap, after: u64) -> EventDecoder<T> {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        EventDecoder {
            sse: SseDecoder::default(),
            request_id: header(RTX_REQUEST_ID),
            log_id: header("x-request-id"),
            traceparent: header(TRACEPARENT),
            last_event_id: after,
            state: State::Open,
            item: PhantomData,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        self.sse.feed(chunk);
    }

    /// The body ended. Unless its last event came, the stream was cut: that is an error (its cursor resumes it).
    pub fn end_of_body(&mut self) -> Option<Error> {
        self.sse.finish();
        (self.state == State::Open).then(|| {
            self.fail(Error::Connection(format!(
                "the stream ended before its last event (after event {})",
                self.last_event_id
            )))
        })
    }

    pub fn fail(&mut self, error: Error) -> Error {
        self.state = State::Failed;
        error
    }

    /// Whether nothing more will come (its end was read, or an error returned); queued items may remain only
    /// while this is false.
    pub fn is_done(&self) -> bool {
        self.state != State::Open
    }

    pub fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    pub fn last_event_id(&self) -> u64 {
        self.last_event_id
    }

    pub fn cursor(&self) -> Option<StreamCursor> {
        let request_id = self.request_id.clone()?;
        Some(StreamCursor { request_id, last_event_id: self.last_event_id })
    }
}

impl<T: StreamEvent> EventDecoder<T> {
    /// The next item decoded so far, or `None` until more bytes come.
    pub fn next_item(&mut self) -> Option<Result<T, Error>> {
        while self.state == State::Open {
            let event = self.sse.pop()?;
            if let Some(id) = event.id.as_deref().and_then(|id| id.trim().parse::<u64>().ok()) {
                self.last_event_id = id;
            }
            if event.data == "[DONE]" {
                self.state = State::Finished;
                return None;
            }
            if event.data.trim().is_empty() {
                continue;
            }
            return Some(self.decode(&event.data));
        }
        None
    }

    fn decode(&mut self, data: &str) -> Result<T, Error> {
        let value: serde_json::Value = match serde_json::from_str(data) {
            Ok(value) => value,
            Err(e) => return Err(self.fail(Error::Decode(format!("stream event {data:?}: {e}")))),
        };
        // An error ends a stream that had started: `{"error": {...}}` and nothing else.
        if value.as_object().is_some_and(|o| o.len() == 1 && o.contains_key("error")) {
            if let Ok(body) = serde_json::from_value::<ErrorBody>(value.clone()) {
                let mut error = body.into_api_error(None);
                error.request_id = self.log_id.clone();
                return Err(self.fail(Error::from(error)));
            }
        }
        match serde_json::from_value::<T>(value) {
            Ok(item) => {
                if item.is_last() {
                    self.state = State::Finished;
                }
                Ok(item)
            }
            Err(e) => Err(self.fail(Error::Decode(format!("stream event {data:?}: {e}")))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ChatChunk, GenerateEvent};
    use crate::ErrorKind;
    use reqwest::header::HeaderValue;

    fn headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RTX_REQUEST_ID, HeaderValue::from_static("rq-1"));
        headers
    }

    fn drain<T: StreamEvent>(decoder: &mut EventDecoder<T>) -> Vec<Result<T, Error>> {
        std::iter::from_fn(|| decoder.next_item()).collect()
    }

    #[test]
    fn an_openai_stream_ends_with_done_and_counts_its_events() {
        let mut decoder = EventDecoder::<ChatChunk>::new(&headers(), 3);
        decoder.feed(b"id: 4\ndata: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n");
        let items = drain(&mut decoder);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].as_ref().unwrap().text(), "Hi");
        assert_eq!(decoder.cursor(), Some(StreamCursor { request_id: "rq-1".into(), last_event_id: 4 }));
        decoder.feed(b"id: 5\ndata: [DONE]\n\nid: 6\ndata: {}\n\n");
        assert!(drain(&mut decoder).is_empty());
        assert!(decoder.is_finished() && decoder.end_of_body().is_none());
        assert_eq!(decoder.last_event_id(), 5);
    }

    #[test]
    fn a_native_stream_ends_with_its_finished_event() {
        let mut decoder = EventDecoder::<GenerateEvent>::new(&headers(), 0);
        decoder.feed(b"id: 1\ndata: {\"text\":\"a\",\"token_ids\":[7],\"finished\":true}\n\n");
        assert!(drain(&mut decoder)[0].as_ref().unwrap().finished);
        assert!(decoder.is_finished());
    }

    #[test]
    fn a_body_ending_early_is_a_cut_and_an_error_event_is_an_api_error() {
        let mut decoder = EventDecoder::<GenerateEvent>::new(&headers(), 0);
        decoder.feed(b"id: 1\ndata: {\"text\":\"a\",\"token_ids\":[7],\"finished\":false}\n\n");
        assert_eq!(drain(&mut decoder).len(), 1);
        assert!(matches!(decoder.end_of_body(), Some(Error::Connection(m)) if m.contains("after event 1")));

        let mut with_log_id = HeaderMap::new();
        with_log_id.insert("x-request-id", HeaderValue::from_static("log-7"));
        let mut decoder = EventDecoder::<GenerateEvent>::new(&with_log_id, 0);
        decoder
            .feed(b"data: {\"error\":{\"message\":\"deadline\",\"type\":\"timeout_error\",\"code\":\"timeout\"}}\n\n");
        let items = drain(&mut decoder);
        let error = items[0].as_ref().unwrap_err().api().unwrap();
        assert_eq!((error.kind, error.message.as_str()), (ErrorKind::DeadlineExceeded, "deadline"));
        assert_eq!(error.request_id.as_deref(), Some("log-7"), "as the response's own refusals carry it");
        assert!(decoder.is_done() && decoder.cursor().is_none());
    }
}
