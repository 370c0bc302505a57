//! The client against a live `rtx serve` on the default model, which tests/client/test_rust_client.py starts with
//! a journal (`--state-dir`) and two tenants: run there, or by hand with
//!
//! ```sh
//! RTX_TEST_BASE_URL=http://127.0.0.1:8000 RTX_TEST_API_KEY=... RTX_TEST_LIMITED_API_KEY=... \
//!     cargo test -- --include-ignored
//! ```
//!
//! where the limited key's tenant may run one request at a time (`max_concurrency = 1`).

use std::time::{Duration, Instant};

use rtx_client::{
    blocking, ChatChunk, ChatMessage, ChatRequest, Client, Completion, CompletionRequest, EmbedRequest,
    EmbeddingsRequest, Error, ErrorKind, GenerateEvent, GenerateRequest, RequestOptions, RetryPolicy, StreamCursor,
    StreamExt,
};

const PROMPT: &str = "The capital of France is";
const NEEDS_SERVER: &str = "needs a live rtx serve: RTX_TEST_BASE_URL, RTX_TEST_API_KEY, RTX_TEST_LIMITED_API_KEY";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{NEEDS_SERVER} ({name} is not set)"))
}

fn base_url() -> String {
    env("RTX_TEST_BASE_URL")
}

fn client() -> Client {
    Client::builder(&base_url()).api_key(env("RTX_TEST_API_KEY")).build().unwrap()
}

fn blocking_client() -> blocking::Client {
    blocking::Client::builder(&base_url()).api_key(env("RTX_TEST_API_KEY")).build_blocking().unwrap()
}

fn greedy_completion(max_tokens: u32) -> CompletionRequest {
    CompletionRequest::new(PROMPT).max_tokens(max_tokens).temperature(0.0)
}

fn hello_chat(max_tokens: u32) -> ChatRequest {
    ChatRequest::new([ChatMessage::user("Say hello.")]).max_tokens(max_tokens).temperature(0.0)
}

fn api_error(result: Result<impl std::fmt::Debug, Error>) -> rtx_client::ApiError {
    match result {
        Err(Error::Api(error)) => *error,
        other => panic!("expected an error answered by the server, got {other:?}"),
    }
}

/// Every item of a stream, with the id of the event that carried it.
async fn collect<T: rtx_client::StreamEvent>(stream: &mut rtx_client::EventStream<T>) -> Vec<(u64, T)> {
    let mut items = Vec::new();
    while let Some(item) = stream.next().await {
        items.push((stream.last_event_id(), item.unwrap()));
    }
    assert!(stream.is_finished());
    items
}

#[tokio::test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
async fn chat_streamed_and_not() {
    let client = client();
    let completion = client.chat(&hello_chat(8)).await.unwrap();
    let reply = completion.text().to_owned();
    assert!(!reply.is_empty());
    assert_eq!(completion.choices[0].message.role, "assistant");
    assert!(completion.usage.unwrap().completion_tokens <= 8);

    let mut stream = client.stream_chat(&hello_chat(8)).await.unwrap();
    let chunks = collect(&mut stream).await;
    assert_eq!(chunks[0].1.choices[0].delta.role.as_deref(), Some("assistant"));
    let streamed: String = chunks.iter().map(|(_, c)| c.text()).collect();
    assert_eq!(streamed, reply);
    assert!(chunks.last().unwrap().1.choices[0].finish_reason.is_some());
    let ids: Vec<u64> = chunks.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, (1..=chunks.len() as u64).collect::<Vec<_>>(), "every event has the next id");
}

#[tokio::test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
async fn completions_native_generate_and_embeddings() {
    let client = client();
    let completion = client.completions(&greedy_completion(6)).await.unwrap();
    let expected = completion.text().to_owned();
    assert_eq!(completion.usage.unwrap().completion_tokens, 6);
    assert_eq!(completion.choices[0].finish_reason.as_deref(), Some("length"));

    let mut stream = client.stream_completions(&greedy_completion(6)).await.unwrap();
    let chunks = collect(&mut stream).await;
    assert_eq!(chunks.iter().map(|(_, c)| c.text()).collect::<String>(), expected);

    let generation = client.generate(&GenerateRequest::new(PROMPT).max_tokens(6).temperature(0.0)).await.unwrap();
    assert_eq!((generation.text.as_str(), generation.num_tokens), (expected.as_str(), 6));
    let mut stream =
        client.stream_generate(&GenerateRequest::new(PROMPT).max_tokens(6).temperature(0.0)).await.unwrap();
    let events = collect(&mut stream).await;
    assert_eq!(events.iter().map(|(_, e)| e.text.as_str()).collect::<String>(), expected);
    let last = &events.last().unwrap().1;
    assert!(last.finished && last.usage.as_ref().unwrap().completion_tokens == 6);

    let embeddings = client
        .embeddings(&EmbeddingsRequest::new(["hello", "world"].into_iter().collect::<rtx_client::Prompts>()))
        .await
        .unwrap();
    assert_eq!(embeddings.data.len(), 2);
    assert!(!embeddings.data[0].embedding.is_empty());
    let embedded = client.embed(&EmbedRequest::new(["hello"])).await.unwrap();
    assert_eq!(embedded.embeddings[0].len(), embeddings.data[0].embedding.len());
    assert!(!client.models().await.unwrap().data[0].id.is_empty());
}

#[test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
fn the_blocking_client_gives_the_same_results() {
    let client = blocking_client();
    let completion = client.completions(&greedy_completion(6)).unwrap();
    let streamed: String =
        client.stream_completions(&greedy_completion(6)).unwrap().map(|c| c.unwrap().text().to_owned()).collect();
    assert_eq!(streamed, completion.text());
    let chat = client.chat(&hello_chat(8)).unwrap();
    let mut stream = client.stream_chat(&hello_chat(8)).unwrap();
    let streamed: String = stream.by_ref().map(|c| c.unwrap().text().to_owned()).collect();
    assert_eq!(streamed, chat.text());
    assert!(stream.is_finished());
    let events: Vec<GenerateEvent> = client
        .stream_generate(&GenerateRequest::new(PROMPT).max_tokens(6).temperature(0.0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(events.iter().map(|e| e.text.as_str()).collect::<String>(), completion.text());
    assert_eq!(client.embed(&EmbedRequest::new(["hello"])).unwrap().num_tokens.len(), 1);
}

#[tokio::test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
async fn a_stream_cut_by_the_client_resumes_with_no_gap_and_no_duplicate() {
    let client = client();
    let request = hello_chat(12).ignore_eos(true);
    let mut stream = client.stream_chat(&request).await.unwrap();
    let mut before = Vec::new();
    for _ in 0..5 {
        let chunk = stream.next().await.unwrap().unwrap();
        before.push((stream.last_event_id(), chunk));
    }
    let cursor = stream.cursor().unwrap();
    assert_eq!(cursor.last_event_id, 5);
    drop(stream); // the cut: the server's journal keeps the request running

    let mut resumed = client.resume::<ChatChunk>(&cursor, &RequestOptions::new()).await.unwrap();
    assert_eq!(resumed.request_id(), Some(cursor.request_id.as_str()));
    let after = collect(&mut resumed).await;
    assert_eq!(after[0].0, 6, "the first event after the cut is the next one");

    // The whole stream, replayed from its start: the two parts are exactly it.
    let from_start = StreamCursor { last_event_id: 0, ..cursor.clone() };
    let whole = collect(&mut client.resume::<ChatChunk>(&from_start, &RequestOptions::new()).await.unwrap()).await;
    let parts: Vec<_> = before.into_iter().chain(after).collect();
    assert_eq!(parts, whole);
    let text: String = whole.iter().map(|(_, c)| c.text()).collect();
    assert_eq!(text, client.chat(&request).await.unwrap().text(), "the same text as without a cut");
}

#[tokio::test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
async fn a_cancelled_stream_ends_with_abort() {
    let client = client();
    let request = GenerateRequest::new(PROMPT).max_tokens(2000).ignore_eos(true);
    let mut stream = client.stream_generate(&request).await.unwrap();
    stream.next().await.unwrap().unwrap();
    let cursor = stream.cursor().unwrap();
    let answer = client.cancel(&cursor, &RequestOptions::new()).await.unwrap();
    assert_eq!((answer.id.as_str(), answer.cancelled), (cursor.request_id.as_str(), true));
    let rest = collect(&mut stream).await;
    let (_, last) = rest.last().unwrap();
    assert!(last.finished && rest.len() < 2000, "ended early");
    assert_eq!(last.finish_reason.as_deref(), Some("abort"));
    // Finished already: nothing to stop.
    assert!(!client.cancel(&cursor, &RequestOptions::new()).await.unwrap().cancelled);
}

#[test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
fn a_blocking_native_stream_cut_and_resumed() {
    let client = blocking_client();
    let request = GenerateRequest::new(PROMPT).max_tokens(8).temperature(0.0).ignore_eos(true);
    let mut stream = client.stream_generate(&request).unwrap();
    let before: Vec<GenerateEvent> = stream.by_ref().take(3).map(Result::unwrap).collect();
    let cursor = stream.cursor().unwrap();
    drop(stream);
    let mut resumed = client.resume::<GenerateEvent>(&cursor, &RequestOptions::new()).unwrap();
    let mut after = Vec::new();
    while let Some(event) = resumed.next() {
        after.push(event.unwrap());
        assert_eq!(resumed.last_event_id(), cursor.last_event_id + after.len() as u64, "no gap, no duplicate");
    }
    assert!(after.last().unwrap().finished);
    let tokens: Vec<u32> = before.iter().chain(&after).flat_map(|e| e.token_ids.iter().copied()).collect();
    assert_eq!(tokens.len(), 8);
    assert_eq!(
        before.iter().chain(&after).map(|e| e.text.as_str()).collect::<String>(),
        client.generate(&request).unwrap().text
    );
}

#[test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
fn a_429_is_retried_after_its_retry_after() {
    // The limited tenant may run one request at a time: while a stream of its runs, its next request is refused
    // with `Retry-After: 1`, however fast or slow the server is.
    let builder = || Client::builder(&base_url()).api_key(env("RTX_TEST_LIMITED_API_KEY"));
    let holder = || GenerateRequest::new(PROMPT).max_tokens(24).ignore_eos(true);
    let request = greedy_completion(1);
    let patiently = RetryPolicy::default().max_attempts(120);

    let impatient = builder().retry(RetryPolicy::none()).build_blocking().unwrap();
    let running = impatient.stream_generate(&holder()).unwrap();
    let refused = api_error(impatient.completions(&request));
    drop(running); // the server's journal keeps it running, and its slot taken, until it finishes
    assert_eq!(
        (refused.kind, refused.status, refused.code.as_deref()),
        (ErrorKind::RateLimited, Some(429), Some("rate_limited"))
    );
    assert!(refused.message.contains("concurrent requests"), "{}", refused.message);
    assert_eq!(refused.retry_after, Some(Duration::from_secs(1)));

    // Refused while the first stream runs, then admitted after waiting what the server asked each time.
    let patient = builder().retry(patiently.clone()).build_blocking().unwrap();
    let start = Instant::now();
    assert_eq!(patient.completions(&request).unwrap().usage.unwrap().completion_tokens, 1);
    assert!(start.elapsed() >= Duration::from_secs(1), "answered after {:?}", start.elapsed());

    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let patient = builder().retry(patiently).build().unwrap();
        let running = patient.stream_generate(&holder()).await.unwrap();
        let start = Instant::now();
        let stream = patient.stream_completions(&request).await.unwrap(); // a stream is retried before it starts
        assert!(start.elapsed() >= Duration::from_secs(1), "admitted after {:?}", start.elapsed());
        assert!(stream.collect::<Vec<_>>().await.into_iter().all(|c| c.is_ok()));
        drop(running);
    });
}

#[tokio::test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
async fn bad_requests_surface_the_servers_message() {
    let client = client();
    let error = api_error(client.completions(&greedy_completion(2).top_p(1.5)).await);
    assert_eq!(
        (error.kind, error.status, error.param.as_deref()),
        (ErrorKind::InvalidRequest, Some(400), Some("top_p"))
    );
    assert!(error.message.contains("top_p"), "{}", error.message);
    assert!(error.request_id.is_some());

    let error = api_error(client.stream_chat(&hello_chat(2).model("no-such-model")).await);
    assert_eq!((error.kind, error.status), (ErrorKind::NotFound, Some(404)));
    assert!(error.message.contains("no-such-model"), "{}", error.message);

    let error = api_error(
        client.stream_completions(&greedy_completion(2).options(RequestOptions::new().lane("platinum"))).await,
    );
    assert_eq!((error.status, error.param.as_deref()), (Some(400), Some("x-rtx-lane")));
    assert!(error.message.contains("unknown lane 'platinum'"), "{}", error.message);

    let error = api_error(Client::builder(&base_url()).api_key("sk-wrong").build().unwrap().models().await);
    assert_eq!((error.kind, error.code.as_deref()), (ErrorKind::Unauthenticated, Some("invalid_api_key")));

    let error = api_error(
        client
            .resume::<Completion>(
                &StreamCursor { request_id: "rq-none".into(), last_event_id: 0 },
                &RequestOptions::new(),
            )
            .await,
    );
    assert_eq!(error.kind, ErrorKind::NotFound);
}

#[tokio::test]
#[ignore = "needs a live rtx serve (tests/client/test_rust_client.py)"]
async fn lanes_trace_context_idempotency_keys_and_timeouts() {
    let client = client();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let options = RequestOptions::new()
        .lane("bulk")
        .traceparent(format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .request_id(format!("rust-client-{}", std::process::id()));
    let mut stream = client.stream_completions(&greedy_completion(2).options(options)).await.unwrap();
    let traceparent = stream.traceparent().unwrap().to_owned();
    assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
    assert_eq!(collect(&mut stream).await[0].1.id, format!("cmpl-rust-client-{}", std::process::id()));

    // The same key and body attach to the first request; the same key with another body is refused.
    let keyed = |key: &str| greedy_completion(3).options(RequestOptions::new().idempotency_key(key));
    let key = format!("rust-{}", std::process::id());
    let first = client.completions(&keyed(&key)).await.unwrap();
    assert_eq!(client.completions(&keyed(&key)).await.unwrap(), first);
    let error = api_error(client.completions(&keyed(&key).max_tokens(4)).await);
    assert_eq!(error.kind, ErrorKind::InvalidRequest);
    assert!(error.message.contains("Idempotency-Key"), "{}", error.message);

    let hurried = greedy_completion(64)
        .ignore_eos(true)
        .options(RequestOptions::new().timeout(Duration::from_millis(50)).retry(RetryPolicy::none()));
    let result = client.completions(&hurried).await;
    assert!(matches!(result, Err(Error::Timeout(_))), "{result:?}");
}
