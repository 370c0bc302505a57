//! A stream cut and resumed, on the blocking client: read part of a completion, drop the connection, then get
//! the rest from the server's journal, with no event missed or repeated.
//!
//! ```sh
//! rtx serve --state-dir /tmp/rtx-state &        # a journal makes streams resumable
//! cd clients/rust/rtx-client && cargo run --example resume_stream
//! ```
//!
//! `RTX_BASE_URL` names another server, `RTX_API_KEY` its API key.

use rtx_client::blocking::Client;
use rtx_client::{CompletionRequest, RequestOptions};

fn main() -> Result<(), rtx_client::Error> {
    let base_url =
        std::env::var("RTX_BASE_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned());
    let mut client = Client::builder(&base_url);
    if let Ok(key) = std::env::var("RTX_API_KEY") {
        client = client.api_key(key);
    }
    let client = client.build_blocking()?;
    let request = CompletionRequest::new("The three primary colours are")
        .max_tokens(32)
        .temperature(0.0);

    // Read the first few events, then go away as a dropped connection would.
    let mut stream = client.stream_completions(&request)?;
    let mut text = String::new();
    for chunk in stream.by_ref().take(4) {
        text.push_str(chunk?.text());
    }
    let cursor = stream
        .cursor()
        .expect("the server names every streamed request");
    drop(stream);
    println!(
        "before the cut (up to event {}): {text:?}",
        cursor.last_event_id
    );

    // The rest, from the event after the cursor; the request ran on meanwhile.
    let mut rest = String::new();
    for chunk in client.resume::<rtx_client::Completion>(&cursor, &RequestOptions::new())? {
        rest.push_str(chunk?.text());
    }
    println!("after it: {rest:?}");
    println!("whole: {}", text + &rest);
    Ok(())
}
