//! Client of rtx-serve's HTTP API: the OpenAI-compatible routes (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/embeddings`, `/v1/models`) and the native ones (`/generate`, `/embed`), async ([`Client`], on Tokio) and
//! blocking ([`blocking::Client`]), with the same methods.
//!
//! ```no_run
//! use rtx_client::{ChatMessage, ChatRequest, Client, StreamExt};
//!
//! # async fn run() -> Result<(), rtx_client::Error> {
//! let client = Client::builder("http://127.0.0.1:8000").api_key("sk-...").build()?;
//! let request = ChatRequest::new(vec![ChatMessage::user("Say hello.")]).max_tokens(32);
//! let mut stream = client.stream_chat(&request).await?;
//! while let Some(chunk) = stream.next().await {
//!     print!("{}", chunk?.text());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! What every call shares:
//! - **Errors** are one [`Error`] enum; what the server refused is [`Error::Api`], carrying its status, its error
//!   `code`, `type`, `param` and message ([`ApiError`], classified by [`ErrorKind`]).
//! - **Retries**: an answer that means "try again later" (429, 503) is retried by the client's [`RetryPolicy`],
//!   after the server's `Retry-After` when it gives one. A stream is retried only before its first event, so
//!   nothing is delivered twice.
//! - **Timeouts** bound connecting, the wait for the answer, and each wait between two events of a stream.
//! - **Per-request options** ([`RequestOptions`]): an `Idempotency-Key`, the SLA lane (`x-rtx-lane`), W3C trace
//!   context (`traceparent`, `tracestate`), a request id (`x-request-id`), and a timeout or retry policy of its own.
//!   The API key (`Authorization: Bearer`) is the client's.
//! - **Resumable streams**: a server started with `--state-dir` keeps every request in a journal. A stream's
//!   [`StreamCursor`] (the request id and the last event received) resumes it after a cut, from the next event:
//!   [`Client::resume`] sends `GET /v1/streams/{id}` with `Last-Event-ID`.
//!
//! gRPC (`spec/rtx.proto`) is not covered: no gRPC stack for Rust (tonic) is packaged by Debian, whose crates this
//! one is built from (see `docs/clients.md`).

mod client;
mod error;
mod options;
mod retry;
mod sse;
mod stream;
mod types;

pub mod blocking;

pub use client::{Client, ClientBuilder, EventStream};
pub use error::{ApiError, Error, ErrorKind};
pub use futures_util::StreamExt;
pub use options::RequestOptions;
pub use retry::{parse_retry_after, RetryPolicy};
pub use stream::{StreamCursor, StreamEvent};
pub use types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatDelta, ChatMessage, ChatRequest, Completion,
    CompletionChoice, CompletionChunk, CompletionRequest, EmbedRequest, EmbedResponse, Embedding, EmbeddingsRequest,
    EmbeddingsResponse, GenerateEvent, GenerateRequest, Generation, Model, ModelList, Prompt, PromptTokensDetails,
    Prompts, SamplingParams, StreamCancellation, Usage,
};

/// What every call returns.
pub type Result<T, E = Error> = std::result::Result<T, E>;
