//! A chat with streaming, on the async client: prints the reply as it is generated.
//!
//! ```sh
//! rtx serve &                                   # http://127.0.0.1:8000
//! cd clients/rust/rtx-client && cargo run --example stream_chat -- "Write a haiku about the sea."
//! ```
//!
//! `RTX_BASE_URL` names another server, `RTX_API_KEY` its API key.

use std::io::Write;

use rtx_client::{ChatMessage, ChatRequest, Client, RequestOptions, StreamExt};

#[tokio::main]
async fn main() -> Result<(), rtx_client::Error> {
    let base_url =
        std::env::var("RTX_BASE_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned());
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "Say hello.".to_owned());
    let mut client = Client::builder(&base_url);
    if let Ok(key) = std::env::var("RTX_API_KEY") {
        client = client.api_key(key);
    }
    let client = client.build()?;

    let request = ChatRequest::new([
        ChatMessage::system("You are concise."),
        ChatMessage::user(question),
    ])
    .max_tokens(64)
    .temperature(0.7)
    .options(RequestOptions::new().lane("realtime"));
    let mut stream = client.stream_chat(&request).await?;
    let mut stdout = std::io::stdout();
    while let Some(chunk) = stream.next().await {
        print!("{}", chunk?.text());
        stdout.flush().ok();
    }
    println!();
    eprintln!(
        "(request {}, {} events)",
        stream.request_id().unwrap_or("?"),
        stream.last_event_id()
    );
    Ok(())
}
