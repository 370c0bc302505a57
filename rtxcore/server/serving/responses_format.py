"""OpenAI's Responses API as a response format: the ``response`` object, and its typed stream events
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``), each numbered by the serving core (``sequence_number``).

The output is a list of items: a ``message`` holding the text, and with tools a ``function_call`` per call the
model made, in the order they appear in its text. Every event follows from the text so far (as chat's tool deltas
do), so a stream resumed after a restart goes on exactly as it would have without one.
"""

from __future__ import annotations

from typing import Any

from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.server.serving.formats import ResponseFormat, chat_logprobs
from rtxcore.server.serving.generation import Choice, Generation
from rtxcore.server.serving.tool_calls import ParsedOutput, parse_output


class ResponsesFormat(ResponseFormat):
    ends_with_done = False  # OpenAI's Responses streams end with their response.completed event
    numbered_events = True
    _message_index: int | None = None

    # -- stream -------------------------------------------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        events = [{"type": t, "response": self._response(None, "in_progress", [])}
                  for t in ("response.created", "response.in_progress")]
        if self.spec.tools is None:  # the text is the whole output: its message is announced at once
            events += self._message_opening(0)
        return events

    def events(self, gen: Generation, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
        logprobs = self._logprobs(out.logprobs or [])
        if self.spec.tools is None:
            if not out.new_text and not logprobs:
                return []
            return [self._delta(0, out.new_text, logprobs)]
        prefix = f"call_{gen.req_id}"
        before = parse_output(choice.text[:len(choice.text) - len(out.new_text)], prefix, False, self.spec.tools)
        after = parse_output(choice.text, prefix, out.finished, self.spec.tools)
        at = self._message_at(choice.text, prefix, out.finished) if after.content.strip() else None
        new_calls = range(len(before.calls), len(after.calls))
        events = [e for j in new_calls if at is None or j < at for e in self._call_events(after, j, at)]
        if at is not None and not before.content.strip():
            events += [*self._message_opening(at), self._delta(at, after.content, logprobs)]
        elif at is not None and len(after.content) > len(before.content):
            events.append(self._delta(at, after.content[len(before.content):], logprobs))
        events += [e for j in new_calls if at is not None and j >= at for e in self._call_events(after, j, at)]
        return events

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        choice = gen.choices[0]
        items, at = self._items(gen, choice)
        events: list[dict[str, Any]] = []
        # With tools the message was announced once it had text that is not blank; without, from the start.
        if at is not None and (self.spec.tools is None or items[at]["content"][0]["text"].strip()):
            message = items[at]
            part = message["content"][0]
            events += [{"type": "response.output_text.done", "item_id": message["id"], "output_index": at,
                        "content_index": 0, "text": part["text"], "logprobs": part["logprobs"]},
                       {"type": "response.content_part.done", "item_id": message["id"], "output_index": at,
                        "content_index": 0, "part": part},
                       {"type": "response.output_item.done", "output_index": at, "item": message}]
        response = self.body(gen)
        done = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, {"type": done, "response": response}]

    # -- whole response -----------------------------------------------------------------------------------------

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        items, _ = self._items(gen, choice)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self._response(gen, status, items)

    def _response(self, gen: Generation | None, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        header = self.spec.header
        usage = None
        if gen is not None:
            counts: dict[str, Any] = gen.usage()
            usage = {"input_tokens": counts["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": counts["total_tokens"]}
        return {"id": header["id"], "object": "response", "created_at": header["created_at"], "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": header["model"], "output": output, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "usage": usage,
                **(self.spec.request or {})}

    def _items(self, gen: Generation, choice: Choice) -> tuple[list[dict[str, Any]], int | None]:
        """The output items in order, and the message's index (None: no message)."""
        logprobs = self._logprobs(choice.logprobs)
        # Cut at max_output_tokens, the message is incomplete, as the response is (a call is whole or not a call).
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        if self.spec.tools is None:
            return [self._message(choice.text, logprobs, status)], 0
        prefix = f"call_{gen.req_id}"
        parsed = parse_output(choice.text, prefix, True, self.spec.tools)
        items = [self._call(parsed, j, "completed") for j in range(len(parsed.calls))]
        if parsed.content.strip() or not parsed.calls:
            at = self._message_at(choice.text, prefix, True) if parsed.content.strip() else 0
            items.insert(at, self._message(parsed.content, logprobs, status))
            return items, at
        return items, None

    # -- items and events ---------------------------------------------------------------------------------------

    def _message_id(self) -> str:
        return "msg_" + self.spec.header["id"].removeprefix("resp_")

    def _message(self, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]
        return {"type": "message", "id": self._message_id(), "status": status, "role": "assistant",
                "content": content if status != "in_progress" else []}

    def _message_opening(self, at: int) -> list[dict[str, Any]]:
        return [{"type": "response.output_item.added", "output_index": at,
                 "item": self._message("", [], "in_progress")},
                {"type": "response.content_part.added", "item_id": self._message_id(), "output_index": at,
                 "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}]

    def _delta(self, at: int, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "response.output_text.delta", "item_id": self._message_id(), "output_index": at,
                "content_index": 0, "delta": text, "logprobs": logprobs}

    def _call(self, parsed: ParsedOutput, j: int, status: str) -> dict[str, Any]:
        call = parsed.calls[j]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}

    def _call_events(self, parsed: ParsedOutput, j: int, message_at: int | None) -> list[dict[str, Any]]:
        """A call is parsed whole: it is announced, its arguments sent as one delta, and completed at once."""
        at = j + 1 if message_at is not None and j >= message_at else j
        item = self._call(parsed, j, "completed")
        added = self._call(parsed, j, "in_progress")
        return [{"type": "response.output_item.added", "output_index": at, "item": added},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": at,
                 "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": at,
                 "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": at, "item": item}]

    def _message_at(self, text: str, prefix: str, final: bool) -> int:
        """The message's place among the items: the number of calls the text holds before its first content (text
        outside calls that is not blank). A function of the text alone, so a resumed stream agrees with the live
        one; found once, by bisecting the shortest prefix whose parse has content."""
        if self._message_index is None:
            assert self.spec.tools is not None
            fmt = self.spec.tools

            def has_content(n: int) -> bool:
                return bool(parse_output(text[:n], prefix, final and n == len(text), fmt).content.strip())

            low, high = 0, len(text)  # has_content(high) holds: the caller saw content
            while low + 1 < high:
                mid = (low + high) // 2
                low, high = (low, mid) if has_content(mid) else (mid, high)
            self._message_index = len(parse_output(text[:high], prefix, final and high == len(text), fmt).calls)
        return self._message_index

    def _logprobs(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        return chat_logprobs(self.tokenizer, lps) if self.spec.logprobs else []
