"""The real default model: token-for-token agreement with Hugging Face transformers, batch invariance, stops."""

from __future__ import annotations

import pytest
import torch

from rtxcore.sampling_params import SamplingParams
from tests.helpers.prompts import PLAIN

pytestmark = pytest.mark.model

MAX_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three prime numbers."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def hf_model(default_model_file):
    transformers = pytest.importorskip("transformers")
    # An independent load path: transformers' own GGUF reader and dequantizer, not ours.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_file.parent), gguf_file=default_model_file.name, dtype=torch.float32)
    # Like our ignore_eos: EOS is just another token, so both run the full length and every token is compared.
    model.generation_config.eos_token_id = None
    return model.eval()


def _prompts(engine) -> list[str]:
    return [engine.inputs.apply_chat_template(c) for c in CHATS] + PLAIN


@pytest.mark.hf
def test_greedy_tokens_equal_hugging_face(default_engine, hf_model):
    prompts = _prompts(default_engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ours = default_engine.generate(prompts, params)
    for prompt, result in zip(prompts, ours):
        ids = torch.tensor([result.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, pad_token_id=0)
        assert result.token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    default_engine.core.kv_cache.reset_prefix_cache()


def test_batch_of_16_equals_alone_and_cache_hits_match(default_engine):
    prompts = _prompts(default_engine)
    extra = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(10)]
    batch = prompts + extra
    assert len(batch) == 16
    params = SamplingParams(max_tokens=24, temperature=0.0)
    default_engine.core.kv_cache.reset_prefix_cache()
    alone = [default_engine.generate([p], params)[0] for p in batch]
    assert all(r.num_cached_tokens == 0 for r in alone[3:6])
    # Same prompts again, all at once: most now hit the prefix cache.
    together = default_engine.generate(batch, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert sum(r.num_cached_tokens for r in together) > 0
    default_engine.core.kv_cache.reset_prefix_cache()


def test_stop_strings_and_eos(default_engine):
    messages = [{"role": "user", "content": "Count from 1 to 20, comma separated."}]
    prompt = default_engine.inputs.apply_chat_template(messages)
    free = default_engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0))[0]
    assert "5" in free.text
    stopped = default_engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, stop=["5"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("5")]
    kept = default_engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, stop=["5"],
                                                            include_stop_str_in_output=True))[0]
    assert kept.text == free.text[: free.text.index("5") + 1]
    # Greedy chat answers end with the model's EOS (<|im_end|>) well before 200 tokens.
    short = default_engine.generate([default_engine.inputs.apply_chat_template(
        [{"role": "user", "content": "Say hello."}])], SamplingParams(max_tokens=200, temperature=0.0))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 200
    default_engine.core.kv_cache.reset_prefix_cache()


@pytest.mark.hf
def test_prompt_logprobs_equal_hugging_face(default_engine, hf_model):
    prompts = [default_engine.inputs.encode(p) for p in PLAIN[:3]]
    scored = default_engine.core.prompt_logprobs(prompts, num_top=3)
    for ids, ours in zip(prompts, scored):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert ours[0] is None and len(ours) == len(ids)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor([lp.logprob for lp in ours[1:]])
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
        assert [[t for t, _ in lp.top] for lp in ours[1:]] == ref[:-1].topk(3).indices.tolist()


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs(default_engine):
    """Scoring prompt + output gives each output token the log-probability the engine reported when sampling it."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    result = default_engine.generate([PLAIN[0]], params)[0]
    scored = default_engine.core.prompt_logprobs([result.prompt_token_ids + result.token_ids], num_top=2)[0]
    tail = scored[len(result.prompt_token_ids):]
    assert [lp.token_id for lp in tail] == result.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in tail]),
                               torch.tensor([lp.logprob for lp in result.logprobs]), atol=2e-3, rtol=0)
