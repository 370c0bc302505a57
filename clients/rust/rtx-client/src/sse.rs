//! Server-sent events (the WHATWG `text/event-stream` format) from the body's bytes, however they are split.
//!
//! Only what a client of rtx-serve needs: `data` (several lines joined by `\n`) and `id`; `event`, `retry` and
//! comments are read and dropped. Lines end with LF, CRLF or CR.

use std::collections::VecDeque;

/// One event of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SseEvent {
    /// The `id` field of this event, when it had one (the server numbers every event from 1).
    pub id: Option<String>,
    pub data: String,
}

#[derive(Debug, Default)]
pub(crate) struct SseDecoder {
    // Bytes after the last complete line.
    partial: Vec<u8>,
    // The last line ended with CR: an LF first in the next chunk ends nothing.
    after_cr: bool,
    data: Option<String>,
    id: Option<String>,
    events: VecDeque<SseEvent>,
}

impl SseDecoder {
    /// Reads a chunk of the body; the events it completes wait in [`SseDecoder::pop`].
    pub fn feed(&mut self, mut chunk: &[u8]) {
        if self.after_cr && chunk.first() == Some(&b'\n') {
            chunk = &chunk[1..];
        }
        self.after_cr = false;
        while let Some(end) = chunk.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.partial.extend_from_slice(&chunk[..end]);
            let line = std::mem::take(&mut self.partial);
            self.line(&String::from_utf8_lossy(&line));
            let crlf = chunk[end] == b'\r' && chunk.get(end + 1) == Some(&b'\n');
            self.after_cr = chunk[end] == b'\r' && end + 1 == chunk.len();
            chunk = &chunk[end + if crlf { 2 } else { 1 }..];
        }
        self.partial.extend_from_slice(chunk);
    }

    /// The body ended: an event not closed by a blank line is dropped, as the format says.
    pub fn finish(&mut self) {
        self.partial.clear();
        self.data = None;
    }

    pub fn pop(&mut self) -> Option<SseEvent> {
        self.events.pop_front()
    }

    fn line(&mut self, line: &str) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                self.events.push_back(SseEvent { id: self.id.take(), data });
            }
            self.id = None;
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            _ => {} // comments (empty field), event, retry
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut decoder = SseDecoder::default();
        let mut events = Vec::new();
        for chunk in chunks {
            decoder.feed(chunk);
            events.extend(std::iter::from_fn(|| decoder.pop()));
        }
        decoder.finish();
        events
    }

    fn event(id: Option<&str>, data: &str) -> SseEvent {
        SseEvent { id: id.map(str::to_owned), data: data.to_owned() }
    }

    #[test]
    fn events_with_ids_whatever_the_chunking() {
        let body = b"id: 1\ndata: {\"a\":1}\n\n: keep-alive\n\nid: 2\ndata: [DONE]\n\n";
        let expected = vec![event(Some("1"), "{\"a\":1}"), event(Some("2"), "[DONE]")];
        assert_eq!(decode(&[body]), expected);
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(decode(&bytes), expected);
    }

    #[test]
    fn crlf_and_cr_line_ends_even_split_between_chunks() {
        assert_eq!(
            decode(&[b"data: a\r\n\r\ndata: b\r\rdata:c\r", b"\n\r\n"]),
            [event(None, "a"), event(None, "b"), event(None, "c")]
        );
    }

    #[test]
    fn multi_line_data_is_joined_and_an_unfinished_event_is_dropped() {
        assert_eq!(decode(&[b"event: x\ndata: one\ndata\ndata:two\n\ndata: cut"]), [event(None, "one\n\ntwo")]);
    }

    #[test]
    fn text_split_inside_a_utf8_character_survives() {
        let body = "data: caf\u{e9} \u{2028}\n\n".as_bytes();
        let (head, tail) = body.split_at(9); // inside the two bytes of the e with an acute accent
        assert_eq!(decode(&[head, tail]), [event(None, "caf\u{e9} \u{2028}")]);
    }
}
