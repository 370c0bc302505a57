"""``rtx chat`` through a real terminal (tmux): multi-turn, streamed, /reset and /exit, local and against a server."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
import uuid

import pytest

from tests.helpers.cli import RTX
from tests.helpers.server import start_server

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Terminal:
    """A detached tmux session running one command; keys in, screen out."""

    def __init__(self, command: list[str]):
        self.name = f"rtx-chat-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50",
                        shlex.join(command) + "; echo EXITED $?; sleep 30"], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-S", "-200", "-t", self.name], capture_output=True,
                              text=True).stdout

    def type(self, text: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, text, "Enter"], check=True)

    def wait_for(self, text: str, count: int = 1, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if screen.count(text) >= count:
                return screen
            if "EXITED" in screen:
                break  # the command ended: what it printed says why
            time.sleep(0.2)
        raise AssertionError(f"{text!r} x{count} did not appear; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def converse(terminal: Terminal) -> str:
    # tmux drops a line's trailing blanks: the prompt shows as ">>>" until something is typed after it.
    terminal.wait_for(">>>")
    terminal.type("What is the capital of France? Answer in one word.")
    terminal.wait_for(">>>", 2)
    terminal.type("/reset")
    terminal.wait_for("(conversation cleared)")
    terminal.wait_for(">>>", 3)
    terminal.type("And of Italy? One word.")
    terminal.wait_for(">>>", 4)
    terminal.type("/exit")
    return terminal.wait_for("EXITED 0")


def answers(screen: str) -> list[str]:
    """The line after each message typed at the prompt: the start of its answer."""
    lines = screen.splitlines()
    return [lines[i + 1].strip() for i, line in enumerate(lines[:-1])
            if line.startswith(">>> ") and not line[4:].startswith("/")]


def test_chat_with_the_local_model():
    terminal = Terminal([RTX, "chat", "--temperature", "0", "--max-tokens", "12", "--system", "You are terse."])
    try:
        screen = converse(terminal)
    finally:
        terminal.close()
    assert "chatting with smollm2-135m" in screen
    first, second = answers(screen)[:2]
    assert "Paris" in first, screen
    assert first and second and "(conversation cleared)" in screen


def test_chat_against_a_server():
    with start_server("--no-grpc") as server:
        terminal = Terminal([RTX, "chat", "--url", server.base_url, "--temperature", "0", "--max-tokens", "12"])
        try:
            screen = converse(terminal)
        finally:
            terminal.close()
    assert "chatting with smollm2-135m" in screen
    assert "Paris" in answers(screen)[0], screen
