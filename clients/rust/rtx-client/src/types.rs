//! Request and response bodies of the HTTP API, as serde types. Responses accept fields they do not know (the
//! server may add some); requests take any further body field with their `param` method.

use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::options::RequestOptions;
use crate::stream::StreamEvent;

/// A prompt: text, or token ids of the model's vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(text: &str) -> Prompt {
        Prompt::Text(text.to_owned())
    }
}

impl From<String> for Prompt {
    fn from(text: String) -> Prompt {
        Prompt::Text(text)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Prompt {
        Prompt::Tokens(ids)
    }
}

/// One prompt, or several (one choice, or one embedding, each).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Prompts {
    One(Prompt),
    Many(Vec<Prompt>),
}

impl<P: Into<Prompt>> From<P> for Prompts {
    fn from(prompt: P) -> Prompts {
        Prompts::One(prompt.into())
    }
}

impl<P: Into<Prompt>> FromIterator<P> for Prompts {
    fn from_iter<I: IntoIterator<Item = P>>(prompts: I) -> Prompts {
        Prompts::Many(prompts.into_iter().map(Into::into).collect())
    }
}

/// The sampling fields every generation takes (the server's `SamplingParams`); unset ones are not sent, and the
/// server's defaults apply.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SamplingParams {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "finite_temperature")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "finite_top_p")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    /// Any 64-bit integer (the server takes negative ones too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    /// Generate `max_tokens` whatever the model's end-of-sequence token says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Any other body field (`logprobs`, `response_format`, `tools`, `cache_salt`, `stream_options`...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

// serde_json writes NaN and infinities as null, which the server would read as "not set" or refuse naming null:
// the request is refused before it is sent instead (Error::InvalidInput), naming the field.
fn finite_temperature<S: Serializer>(value: &Option<f32>, serializer: S) -> Result<S::Ok, S::Error> {
    finite("temperature", value, serializer)
}

fn finite_top_p<S: Serializer>(value: &Option<f32>, serializer: S) -> Result<S::Ok, S::Error> {
    finite("top_p", value, serializer)
}

fn finite<S: Serializer>(name: &str, value: &Option<f32>, serializer: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) if !v.is_finite() => Err(serde::ser::Error::custom(format!("{name} must be a finite number, got {v}"))),
        _ => value.serialize(serializer),
    }
}

/// The builder methods every request has: its sampling fields, further body fields and its options.
macro_rules! request_setters {
    () => {
        pub fn max_tokens(mut self, max_tokens: u32) -> Self {
            self.params.max_tokens = Some(max_tokens);
            self
        }

        pub fn temperature(mut self, temperature: f32) -> Self {
            self.params.temperature = Some(temperature);
            self
        }

        pub fn top_p(mut self, top_p: f32) -> Self {
            self.params.top_p = Some(top_p);
            self
        }

        pub fn top_k(mut self, top_k: i32) -> Self {
            self.params.top_k = Some(top_k);
            self
        }

        pub fn seed(mut self, seed: i64) -> Self {
            self.params.seed = Some(seed);
            self
        }

        pub fn stop<S: Into<String>>(mut self, stop: impl IntoIterator<Item = S>) -> Self {
            self.params.stop = Some(stop.into_iter().map(Into::into).collect());
            self
        }

        pub fn ignore_eos(mut self, ignore_eos: bool) -> Self {
            self.params.ignore_eos = Some(ignore_eos);
            self
        }

        /// Any other body field, as the server's API reference names it.
        pub fn param(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
            self.params.extra.insert(name.into(), value.into());
            self
        }

        /// Headers and transport settings of this request: idempotency key, lane, trace context, timeout...
        pub fn options(mut self, options: RequestOptions) -> Self {
            self.options = options;
            self
        }
    };
}

/// A message of a chat. Fields besides `role` and `content` (`tool_calls`, `tool_call_id`, `name`) are in
/// `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` in an assistant message that only calls tools.
    pub content: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: Some(content.into()), extra: Map::new() }
    }

    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// The served model's name; `None` for the server's model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(flatten)]
    pub params: SamplingParams,
    #[serde(skip)]
    pub options: RequestOptions,
}

impl ChatRequest {
    pub fn new(messages: impl IntoIterator<Item = ChatMessage>) -> ChatRequest {
        ChatRequest {
            messages: messages.into_iter().collect(),
            model: None,
            params: SamplingParams::default(),
            options: RequestOptions::default(),
        }
    }

    pub fn model(mut self, model: impl Into<String>) -> ChatRequest {
        self.model = Some(model.into());
        self
    }

    request_setters!();
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionRequest {
    pub prompt: Prompts,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(flatten)]
    pub params: SamplingParams,
    #[serde(skip)]
    pub options: RequestOptions,
}

impl CompletionRequest {
    /// One prompt (`"text"`, `vec![token ids]`), or several (`prompts.into_iter().collect::<Prompts>()`): one
    /// choice each.
    pub fn new(prompt: impl Into<Prompts>) -> CompletionRequest {
        CompletionRequest {
            prompt: prompt.into(),
            model: None,
            params: SamplingParams::default(),
            options: RequestOptions::default(),
        }
    }

    pub fn model(mut self, model: impl Into<String>) -> CompletionRequest {
        self.model = Some(model.into());
        self
    }

    request_setters!();
}

/// `POST /generate`, the native route: one prompt, sampling fields at the top level. It refuses body fields it
/// does not know (`lane`, `cache_salt`, `draft_token_ids`, `speculative` and the server's `SamplingParams`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub params: SamplingParams,
    #[serde(skip)]
    pub options: RequestOptions,
}

impl GenerateRequest {
    pub fn new(prompt: impl Into<Prompt>) -> GenerateRequest {
        GenerateRequest { prompt: prompt.into(), params: SamplingParams::default(), options: RequestOptions::default() }
    }

    request_setters!();
}

/// `POST /v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbeddingsRequest {
    pub input: Prompts,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip)]
    pub options: RequestOptions,
}

impl EmbeddingsRequest {
    pub fn new(input: impl Into<Prompts>) -> EmbeddingsRequest {
        EmbeddingsRequest { input: input.into(), model: None, options: RequestOptions::default() }
    }

    pub fn model(mut self, model: impl Into<String>) -> EmbeddingsRequest {
        self.model = Some(model.into());
        self
    }

    pub fn options(mut self, options: RequestOptions) -> EmbeddingsRequest {
        self.options = options;
        self
    }
}

/// `POST /embed`, the native route: one embedding per input.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbedRequest {
    pub inputs: Vec<Prompt>,
    #[serde(skip)]
    pub options: RequestOptions,
}

impl EmbedRequest {
    pub fn new<P: Into<Prompt>>(inputs: impl IntoIterator<Item = P>) -> EmbedRequest {
        EmbedRequest { inputs: inputs.into_iter().map(Into::into).collect(), options: RequestOptions::default() }
    }

    pub fn options(mut self, options: RequestOptions) -> EmbedRequest {
        self.options = options;
        self
    }
}

// -- responses ----------------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    #[serde(default)]
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV cache was reused from earlier requests.
    pub cached_tokens: u32,
}

/// `/v1/completions`: the whole response, or (streaming) one chunk of it, whose choices hold new text.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Completion {
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// In a stream, only in its last chunk, and only with `stream_options: {"include_usage": true}`.
    pub usage: Option<Usage>,
}

/// A streamed `/v1/completions` chunk: the same shape as the whole response.
pub type CompletionChunk = Completion;

impl Completion {
    /// The text of the first choice.
    pub fn text(&self) -> &str {
        self.choices.first().map_or("", |c| c.text.as_str())
    }
}

impl StreamEvent for Completion {}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// `stop`, `length`...; `None` until the choice's last chunk.
    pub finish_reason: Option<String>,
    pub logprobs: Option<Value>,
}

/// `/v1/chat/completions` without streaming.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatCompletion {
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Option<Usage>,
}

impl ChatCompletion {
    /// The content of the first choice's message.
    pub fn text(&self) -> &str {
        self.choices.first().and_then(|c| c.message.content.as_deref()).unwrap_or("")
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub finish_reason: Option<String>,
    pub logprobs: Option<Value>,
}

/// One chunk of a streamed chat completion.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatChunk {
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    pub usage: Option<Usage>,
}

impl ChatChunk {
    /// The new content of the first choice ("" for a chunk that adds none).
    pub fn text(&self) -> &str {
        self.choices.first().and_then(|c| c.delta.content.as_deref()).unwrap_or("")
    }
}

impl StreamEvent for ChatChunk {}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub finish_reason: Option<String>,
    pub logprobs: Option<Value>,
}

/// What a chunk adds to its choice's message.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ChatDelta {
    /// Only in the first chunk.
    pub role: Option<String>,
    pub content: Option<String>,
    pub tool_calls: Option<Vec<Value>>,
}

/// An event of the native `/generate` stream: the new text and token ids; the last one has `finished`, its
/// `finish_reason` and the usage.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct GenerateEvent {
    pub text: String,
    #[serde(default)]
    pub token_ids: Vec<u32>,
    pub finished: bool,
    pub finish_reason: Option<String>,
    pub usage: Option<Usage>,
    pub logprobs: Option<Value>,
}

impl StreamEvent for GenerateEvent {
    fn is_last(&self) -> bool {
        self.finished
    }
}

/// The native `/generate` without streaming.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Generation {
    pub id: String,
    #[serde(default)]
    pub model: String,
    pub text: String,
    pub num_tokens: u32,
    pub finish_reason: Option<String>,
    pub logprobs: Option<Value>,
    pub usage: Option<Usage>,
}

/// `/v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EmbeddingsResponse {
    pub data: Vec<Embedding>,
    #[serde(default)]
    pub model: String,
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Embedding {
    pub index: u32,
    pub embedding: Vec<f32>,
}

/// The native `/embed`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EmbedResponse {
    #[serde(default)]
    pub model: String,
    pub embeddings: Vec<Vec<f32>>,
    /// The tokens of each input.
    pub num_tokens: Vec<u32>,
}

/// The answer of `DELETE /v1/streams/{id}` ([`Client::cancel`](crate::Client::cancel)).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StreamCancellation {
    pub id: String,
    /// Whether it was still running (false: it had finished already).
    pub cancelled: bool,
}

/// `/v1/models`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ModelList {
    pub data: Vec<Model>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Model {
    pub id: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub owned_by: String,
    /// The model's own name, under whatever name it is served.
    pub root: Option<String>,
    pub max_model_len: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn non_finite_sampling_numbers_are_refused_before_sending() {
        // serde_json wrote them as null, which the server refused as "got None".
        for (request, field) in [
            (GenerateRequest::new("hi").temperature(f32::NAN), "temperature"),
            (GenerateRequest::new("hi").top_p(f32::INFINITY), "top_p"),
        ] {
            let error = crate::options::json_body(&request).unwrap_err();
            assert!(
                matches!(&error, crate::Error::InvalidInput(m) if m.contains(&format!("{field} must be a finite number"))),
                "{error}"
            );
        }
        let negative_seed = crate::options::json_body(&GenerateRequest::new("hi").seed(-7)).unwrap();
        assert!(String::from_utf8(negative_seed).unwrap().contains("\"seed\":-7"));
    }

    #[test]
    fn requests_send_only_what_was_set() {
        let request = ChatRequest::new([ChatMessage::user("Hi")]).max_tokens(6).temperature(0.0).param("lane", "bulk");
        assert_eq!(
            serde_json::to_value(&request).unwrap(),
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0.0,
                   "lane": "bulk"})
        );
        let batch: Prompts = vec![vec![1u32, 2], vec![3]].into_iter().collect();
        let request = CompletionRequest::new(batch).stop(["\n"]);
        assert_eq!(serde_json::to_value(&request).unwrap(), json!({"prompt": [[1, 2], [3]], "stop": ["\n"]}));
        let request = GenerateRequest::new(vec![5u32, 6]).ignore_eos(true);
        assert_eq!(serde_json::to_value(&request).unwrap(), json!({"prompt": [5, 6], "ignore_eos": true}));
    }

    #[test]
    fn responses_accept_fields_they_do_not_know() {
        let body = json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "new": 1,
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                       "logprobs": null, "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                                    "prompt_tokens_details": {"cached_tokens": 0}}});
        let completion: ChatCompletion = serde_json::from_value(body).unwrap();
        assert_eq!((completion.text(), completion.usage.as_ref().map(|u| u.total_tokens)), ("Hello", Some(4)));
    }
}
