"""`gym-client chat` against a real `gym-serve` process on 127.0.0.1, with a scripted stdin."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from processes import stop
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from zoo_gym.cli.client import app
from zoo_gym.simulation.demo import free_port

pytestmark = pytest.mark.e2e

KEY = "sk-chat-test"


@pytest.fixture(scope="module")
def url(tiny_home_template: Path) -> Iterator[str]:
    """`gym-serve` over the tiny home's models (v0000), key `KEY`, until the module ends."""
    port = free_port()
    models = str(tiny_home_template / "models")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zoo_gym.cli.serve", "--models", models, "--port", str(port)],
        env={**os.environ, "ZOO_SERVE_API_KEY": KEY},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gym-serve did not start")
            time.sleep(0.2)
        yield base
    finally:
        stop(proc)


def greedy_reply(directory: Path, messages: list[dict[str, str]]) -> str:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, pad_token_id=0)
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def test_chat_answers_each_line_with_the_conversation_so_far(
    url: str, tiny_home_template: Path
) -> None:
    directory = tiny_home_template / "models" / "v0000"
    first = [{"role": "user", "content": "What is 8 + 36?"}]
    reply = greedy_reply(directory, first)
    second = [*first, {"role": "assistant", "content": reply}]
    second.append({"role": "user", "content": "And 2 + 2?"})

    done = CliRunner().invoke(
        app,
        ["chat", url, "--api-key", KEY, "--temperature", "0", "--max-tokens", "32"],
        input="What is 8 + 36?\n\nAnd 2 + 2?\n/exit\nnever sent\n",
    )

    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[0] == f"chatting with v0000 at {url} (/exit leaves)"
    assert lines[1:] == [reply, greedy_reply(directory, second)]


def test_chat_with_a_wrong_key_says_so_in_one_line(url: str) -> None:
    done = CliRunner().invoke(app, ["chat", url, "--api-key", "sk-wrong"], input="hi\n")

    assert done.exit_code == 1
    assert done.stderr.strip() == (
        "error: the server answered 401: the API key is not valid; "
        "check the key the server's operator gave you"
    )


def test_chat_without_a_server_says_so(tiny_home_template: Path) -> None:
    port = free_port()

    done = CliRunner().invoke(app, ["chat", f"http://127.0.0.1:{port}"], input="hi\n")

    assert done.exit_code == 1
    assert done.stderr.startswith(f"error: cannot reach http://127.0.0.1:{port}")
