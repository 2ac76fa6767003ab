"""`gym-serve` as a real process on 127.0.0.1, talked to with the official `openai` client and curl.

The models root holds the tiny base (v0000, pretrained: short answers), a randomly initialised
v0001 (long answers, so streams and limits have tokens to cut) and the BitDelta variant of v0001
against v0000. Greedy answers are checked against Hugging Face's `generate` on the same weights.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from processes import stop
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.tls import write_tls_material
from zoo_gym.coordinator.variants import apply_variant, variant_paths, write_variant
from zoo_gym.core.identity import Identity
from zoo_gym.core.tiny import build_tiny_model
from zoo_gym.core.weights import load_weights
from zoo_gym.serving.api_guard import key_digest
from zoo_gym.serving.server import ServeSettings, check_tls
from zoo_gym.simulation.demo import free_port

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

KEY = "sk-zoo-test-key"
MAX_BODY = 65_536
QUESTION = [{"role": "user", "content": "What is 8 + 36?"}]
READ_TIMEOUT_S = 1.0  # the slow-client tests' deadline; the default (30 s) would take minutes


@dataclass
class Server:
    url: str
    root: Path
    proc: subprocess.Popen[bytes]
    log: Path
    ca: Path | None = None  # the CA of its certificate, where it serves HTTPS

    def client(self, key: str = KEY) -> Any:
        http = httpx.Client(verify=str(self.ca)) if self.ca else None
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120, http_client=http
        )

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Each sample of `/metrics` by (name, sorted labels)."""
        reply = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        reply.raise_for_status()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(reply.text)
            for sample in family.samples
        }

    def stats(self) -> dict[str, Any]:
        reply = httpx.get(f"{self.url}/stats", headers={"Authorization": f"Bearer {KEY}"})
        return dict(reply.json())


def models_root(template: Path, target: Path) -> tuple[Path, Identity]:
    """The template's models (v0000) plus a random v0001 and its variant, signed alike."""
    shutil.copytree(template / "models", target)
    signer = Identity.load(template / "coordinator.key")
    registry = ModelRegistry(target, signer)
    vocab = len(AutoTokenizer.from_pretrained(target / "v0000"))
    weights = build_tiny_model(vocab_size=vocab, seed=1).state_dict()
    registry.publish(
        weights, parent="v0000", round_number=1, aggregator="fedavg", contributors=(), metrics={}
    )
    write_variant(registry, "v0001")
    return target, signer


LIMIT_FILES = (
    "import resource, runpy, sys; n = int(sys.argv.pop(1)); "
    "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard)); "
    "runpy.run_module('zoo_gym.cli.serve', run_name='__main__')"
)
"""`python -c LIMIT_FILES N ...`: gym-serve with at most N open descriptors (RLIMIT_NOFILE)."""


def start(
    root: Path, signer: Identity, *args: str, files: int = 0, ca: Path | None = None
) -> Server:
    """`gym-serve` on a free loopback port, once it answers /health (else its log); with
    `files`, allowed that many open descriptors; with `ca`, over HTTPS (`args` give its
    certificate)."""
    port = free_port()
    keys = root.parent / "keys.txt"
    keys.write_text(f"# test key\n{key_digest(KEY)}\n")
    log = root.parent / f"serve-{port}.log"
    program = ["-c", LIMIT_FILES, str(files)] if files else ["-m", "zoo_gym.cli.serve"]
    argv = [sys.executable, *program, "--models", str(root), "--port", str(port)]
    argv += ["--api-key-file", str(keys), "--coordinator-key", signer.public_key.hex(), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    scheme = "https" if ca else "http"
    server = Server(f"{scheme}://127.0.0.1:{port}", root, proc, log, ca)
    verify = str(ca) if ca else True
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=1, verify=verify).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"gym-serve did not start:\n{log.read_text()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root, signer = models_root(tiny_home_template, tmp_path_factory.mktemp("serve") / "models")
    extra = ("--batch-wait-ms", "300", "--max-new-tokens", "64", "--max-body-bytes", str(MAX_BODY))
    served = start(root, signer, *extra)
    try:
        yield served
    finally:
        stop(served.proc)


def greedy(root: Path, version: str, ids: list[int], max_new_tokens: int) -> str:
    """Hugging Face's greedy `generate` on `version`: the reference every answer is held to."""
    tokenizer = AutoTokenizer.from_pretrained(root / version)
    model = AutoModelForCausalLM.from_pretrained(root / version, dtype=torch.float32)
    out = model.generate(
        torch.tensor([ids]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def prompt_ids(root: Path, version: str, prompt: str) -> list[int]:
    return list(AutoTokenizer.from_pretrained(root / version)(prompt)["input_ids"])


def chat_ids(root: Path, version: str, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(root / version)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- the models -------------------------------------------------------------------------------


def test_models_lists_every_version_and_the_variant(server: Server) -> None:
    client = server.client()

    listed = {m.id: m for m in client.models.list()}
    one = client.models.retrieve("v0001")

    assert set(listed) == {"v0000", "v0001", "v0001-from-v0000"}
    assert one.owned_by == "zoo-gym"
    assert one.model_extra is not None and one.model_extra["parent"] == "v0000"
    assert listed["v0001-from-v0000"].model_extra["parent"] == "v0000"  # type: ignore[index]


# --- answers ------------------------------------------------------------------------------------


def test_a_greedy_completion_is_generates_own(server: Server) -> None:
    ids = prompt_ids(server.root, "v0001", "12 + 7 =")

    done = server.client().completions.create(
        model="v0001", prompt="12 + 7 =", max_tokens=24, temperature=0
    )

    assert done.choices[0].text == greedy(server.root, "v0001", ids, 24)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 24)
    assert done.id.startswith("cmpl-") and done.model == "v0001"


def test_a_greedy_chat_uses_the_chat_template(server: Server) -> None:
    ids = chat_ids(server.root, "v0000", QUESTION)

    done = server.client().chat.completions.create(
        model="v0000",
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )

    reply = done.choices[0].message
    assert reply.role == "assistant"
    assert reply.content == greedy(server.root, "v0000", ids, 40)
    assert done.choices[0].finish_reason == "stop"  # the tiny base ends its answer with EOS
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)


def test_chat_chunks_reassemble_to_the_answer(server: Server) -> None:
    client = server.client()
    whole = client.chat.completions.create(
        model="v0001", messages=QUESTION, max_tokens=20, temperature=0
    )

    chunks = list(
        client.chat.completions.create(
            model="v0001",
            messages=QUESTION,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len(chunks) > 3  # streamed token by token, not in one piece
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completion_chunks_reassemble_to_the_answer(server: Server) -> None:
    client = server.client()
    whole = client.completions.create(model="v0001", prompt="3 4", max_tokens=16, temperature=0)

    chunks = list(
        client.completions.create(
            model="v0001", prompt="3 4", max_tokens=16, temperature=0, stream=True
        )
    )

    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_curl_streams_server_sent_events(server: Server) -> None:
    body = {"model": "v0001", "prompt": "5", "max_tokens": 12, "temperature": 0, "stream": True}
    whole = server.client().completions.create(
        model="v0001", prompt="5", max_tokens=12, temperature=0
    )

    headers = ["-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json"]
    done = subprocess.run(
        ["curl", "-sS", "-N", f"{server.url}/v1/completions", *headers, "-d", json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    events = [e for e in done.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text


def test_a_stop_string_ends_the_answer_before_it(server: Server) -> None:
    client = server.client()
    free = client.completions.create(model="v0001", prompt="9", max_tokens=30, temperature=0)
    text = free.choices[0].text
    stop = text[10:13]

    cut = client.completions.create(
        model="v0001", prompt="9", max_tokens=30, temperature=0, stop=[stop]
    )

    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_seed_repeats_a_sampled_answer(server: Server) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        done = client.completions.create(
            model="v0001", prompt="1 2", max_tokens=20, temperature=1.0, top_p=0.9, seed=seed
        )
        return str(done.choices[0].text)

    first, again, other = sample(7), sample(7), sample(8)

    assert first == again
    assert first != other


def test_the_variant_answers_as_its_parent_plus_the_decoded_delta(server: Server) -> None:
    envelope, _ = variant_paths(server.root, "v0001", "v0000")
    merged = apply_variant(load_weights(server.root / "v0000"), envelope.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(server.root / "v0000", dtype=torch.float32)
    model.load_state_dict(merged)
    ids = prompt_ids(server.root, "v0000", "7")
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, pad_token_id=0)
    tokenizer = AutoTokenizer.from_pretrained(server.root / "v0000")

    done = server.client().completions.create(
        model="v0001-from-v0000", prompt="7", max_tokens=16, temperature=0
    )

    assert done.choices[0].text == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


# --- batching ----------------------------------------------------------------------------------


def alone_and_together(
    server: Server, models: list[str], prompts: list[str], max_tokens: int
) -> tuple[list[str], list[str], int]:
    """Greedy answers of each (model, prompt) asked alone, then all at once; and how many
    forward passes of four rows ran meanwhile."""
    client = server.client()

    def ask(i: int) -> str:
        done = client.completions.create(
            model=models[i], prompt=prompts[i], max_tokens=max_tokens, temperature=0
        )
        return done.choices[0].text

    alone = [ask(i) for i in range(len(prompts))]
    before = server.stats()["rows_per_forward"].get("4", 0)
    together: list[str] = [""] * len(prompts)
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, ask(i)))
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return alone, together, server.stats()["rows_per_forward"].get("4", 0) - before


def test_concurrent_requests_run_in_one_batch_and_answer_as_alone(server: Server) -> None:
    prompts = ["1", "22 + 3", "What is 4 + 4? The answer", "7 7 7"]

    alone, together, batches_of_four = alone_and_together(server, ["v0001"] * 4, prompts, 24)

    assert batches_of_four > 0
    assert together == alone


def test_a_variant_and_its_parent_share_one_forward_pass(server: Server) -> None:
    models = ["v0000", "v0001-from-v0000", "v0000", "v0001-from-v0000"]
    prompts = ["1", "22 + 3", "7 7 7", "What is 4 + 4? The answer"]

    alone, together, batches_of_four = alone_and_together(server, models, prompts, 16)

    # the variant's rows ran in the parent's batches of four (no merged copy), and every row
    # answered as it does alone
    assert batches_of_four > 0
    assert together == alone
    variants = server.stats()["variants"]["v0000"]  # read once at the start, then kept
    assert (variants["loaded"], variants["loads"], variants["evictions"]) == (1, 1, 0)
    assert variants["hits"] > 0 and 0 < variants["bytes"] <= variants["budget_bytes"]


def test_metrics_count_a_request_and_time_its_forward_passes(server: Server) -> None:
    """One greedy request alone: its tokens, its end, one prefill, a decode pass per token
    after the first, and one time to first token, as Prometheus scrapes them."""
    before = server.metrics()
    done = server.client().completions.create(
        model="v0001-from-v0000", prompt="7", max_tokens=6, temperature=0
    )
    after = server.metrics()

    def added(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    usage, reason = done.usage, done.choices[0].finish_reason
    assert usage is not None
    assert added("zoo_gym_serve_requests_total") == 1
    assert added("zoo_gym_serve_requests_finished_total", reason=reason) == 1
    assert added("zoo_gym_serve_prompt_tokens_total") == usage.prompt_tokens
    assert added("zoo_gym_serve_completion_tokens_total") == usage.completion_tokens
    assert added("zoo_gym_serve_forward_seconds_count", phase="prefill") == 1
    decodes = added("zoo_gym_serve_forward_seconds_count", phase="decode")
    assert decodes == usage.completion_tokens - 1  # the first token comes from the prefill
    assert added("zoo_gym_serve_time_to_first_token_seconds_count") == 1
    assert 0 < added("zoo_gym_serve_time_to_first_token_seconds_sum") < 60
    assert added("zoo_gym_serve_variant_hits_total", version="v0000") >= 1 + decodes
    assert after[("zoo_gym_serve_variants_pinned", (("version", "v0000"),))] == 0
    assert after[("zoo_gym_serve_requests_running", ())] == 0
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # no key


# --- refusals -----------------------------------------------------------------------------------


def test_a_wrong_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        server.client("sk-wrong").models.list()

    assert refused.value.status_code == 401
    assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # no key at all


def test_an_unknown_model_is_404_in_openais_shape(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        server.client().chat.completions.create(model="v9999", messages=QUESTION)

    error = refused.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and "v9999" in error["message"]


def test_too_many_tokens_are_one_clear_400(server: Server) -> None:
    client = server.client()

    with pytest.raises(openai.BadRequestError) as asked:
        client.completions.create(model="v0001", prompt="1", max_tokens=65)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="v0001", prompt="1 " * 300, max_tokens=4)

    assert asked.value.response.json()["error"]["message"] == (
        "max_tokens is 65; this server generates 1 to 64"
    )
    assert "this server takes at most 255" in long.value.response.json()["error"]["message"]


def test_an_oversized_body_is_413_before_it_is_read(server: Server) -> None:
    body = json.dumps({"model": "v0001", "prompt": "x" * MAX_BODY})

    reply = httpx.post(
        f"{server.url}/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )

    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"


def test_a_malformed_body_names_the_field(server: Server) -> None:
    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "v0000", "messages": [{"role": "robot", "content": "hi"}]},
        headers={"Authorization": f"Bearer {KEY}"},
    )

    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages.0.role"
    assert "robot" not in reply.text  # the input is never repeated


def test_too_many_stop_sequences_say_so_not_that_a_string_was_expected(server: Server) -> None:
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "v0000", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
        headers={"Authorization": f"Bearer {KEY}"},
    )

    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "stop"
    assert error["message"] == "stop: List should have at most 4 items after validation, not 5"


def test_no_key_on_a_public_address_refuses_to_start(tiny_home_template: Path) -> None:
    models = str(tiny_home_template / "models")
    done = subprocess.run(
        [sys.executable, "-m", "zoo_gym.cli.serve", "--models", models, "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ZOO_SERVE_API_KEY": ""},
    )

    assert done.returncode == 1
    assert done.stderr.startswith("error: no API key configured")
    assert len(done.stderr.strip().splitlines()) == 1


# --- TLS -----------------------------------------------------------------------------------------


def test_tls_serves_https_with_the_coordinators_certificate(
    tiny_home_template: Path, tmp_path: Path
) -> None:
    """A certificate made as `gym-coordinator init --tls` makes one: clients that trust its CA
    are answered, plain HTTP and clients that do not trust it are not."""
    root = tmp_path / "models"
    shutil.copytree(tiny_home_template / "models", root)
    tls = write_tls_material(tmp_path / "tls", ["127.0.0.1"])
    signer = Identity.load(tiny_home_template / "coordinator.key")
    pair = ("--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key))
    served = start(root, signer, "--no-variants", *pair, ca=tls.ca_cert)
    try:
        done = served.client().completions.create(
            model="v0000", prompt="7", max_tokens=3, temperature=0
        )
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{served.url}/health")  # the system's CAs do not know it
        with pytest.raises(httpx.HTTPError):
            httpx.get(served.url.replace("https://", "http://") + "/health")
    finally:
        stop(served.proc)

    assert done.choices[0].finish_reason in ("stop", "length")
    assert "on https://127.0.0.1:" in served.log.read_text()


def test_plain_http_beyond_loopback_is_said_at_the_start(caplog: pytest.LogCaptureFixture) -> None:
    assert check_tls(ServeSettings(models=Path("models"), host="0.0.0.0")) is False
    assert "over plain HTTP: API keys and prompts travel in clear" in caplog.text
    caplog.clear()
    assert check_tls(ServeSettings(models=Path("models"))) is False  # 127.0.0.1
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        (("cert",), "error: --tls-cert and --tls-key go together; give both (PEM files)"),
        (("cert", "other"), "cannot serve TLS (the key is not the certificate's); give a"),
        (("key", "key"), "cannot serve TLS (not a PEM certificate and key: "),
        (("missing", "key"), "cannot serve TLS (No such file or directory); give a PEM"),
    ],
)
def test_a_tls_pair_that_cannot_serve_refuses_to_start_in_one_line(
    tiny_home_template: Path, tmp_path: Path, pair: tuple[str, ...], message: str
) -> None:
    ours = write_tls_material(tmp_path / "ours", ["127.0.0.1"])
    theirs = write_tls_material(tmp_path / "theirs", ["127.0.0.1"])
    files = {
        "cert": ours.server_cert,
        "key": ours.server_key,
        "other": theirs.server_key,
        "missing": tmp_path / "missing.pem",
    }
    args = ["--tls-cert", str(files[pair[0]])]
    if len(pair) > 1:
        args += ["--tls-key", str(files[pair[1]])]
    models = str(tiny_home_template / "models")
    done = subprocess.run(
        [sys.executable, "-m", "zoo_gym.cli.serve", "--models", models, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1
    assert message in done.stderr and done.stderr.startswith("error: ")
    assert len(done.stderr.strip().splitlines()) == 1


# --- slow clients ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hurried(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`gym-serve` on v0000 alone with a read deadline of READ_TIMEOUT_S, short so that a test
    waits seconds for it (the default gives a slow but honest network half a minute)."""
    root = tmp_path_factory.mktemp("hurried") / "models"
    shutil.copytree(tiny_home_template / "models", root)
    signer = Identity.load(tiny_home_template / "coordinator.key")
    served = start(root, signer, "--no-variants", "--read-timeout-s", str(READ_TIMEOUT_S))
    try:
        yield served
    finally:
        stop(served.proc)


def trickle(
    url: str, *, body: bool = False, every_s: float = 0.2, give_up_s: float = 15.0
) -> tuple[float, bytes | None]:
    """Send a request one byte every `every_s`: a head that never ends, or (`body`) a whole head
    and then its declared 1 KiB body. Seconds until the server answered or closed, and what it
    sent (b"": it closed without a word; None: it still listened after `give_up_s`)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    head = b"POST /v1/completions HTTP/1.1\r\nHost: serve\r\n"
    head += f"Authorization: Bearer {KEY}\r\n".encode()
    drip: Iterator[bytes]
    if body:
        head += b"Content-Type: application/json\r\nContent-Length: 1024\r\n\r\n"
        drip = itertools.repeat(b"{")
    else:  # the head byte by byte, then a header whose value never ends
        drip = itertools.chain((bytes([c]) for c in head + b"X-Slow: "), itertools.repeat(b"x"))
    start = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=give_up_s) as sock:
        poller = select.poll()  # not select.select: a busy test process has descriptors past 1024
        poller.register(sock, select.POLLIN)
        with contextlib.suppress(OSError):  # the server closed while we sent: read what it said
            if body:
                sock.sendall(head)
            while not poller.poll(0) and time.monotonic() - start < give_up_s:
                sock.sendall(next(drip))
                time.sleep(every_s)
        took = time.monotonic() - start
        if not poller.poll(0):
            return took, None
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
        return took, answer


def test_a_trickled_head_is_closed_at_the_deadline(hurried: Server) -> None:
    took, answer = trickle(hurried.url)

    assert answer == b""  # closed without an answer
    assert READ_TIMEOUT_S * 0.9 < took < READ_TIMEOUT_S + 5
    assert hurried.client().models.list().data[0].id == "v0000"


def test_a_trickled_body_is_408(hurried: Server) -> None:
    took, answer = trickle(hurried.url, body=True)

    assert answer is not None
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"\r\nconnection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert READ_TIMEOUT_S * 0.9 < took < READ_TIMEOUT_S + 5


def test_keep_alive_requests_are_served_past_the_deadline(hurried: Server) -> None:
    with httpx.Client(base_url=hurried.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        first = http.get("/v1/models")
        time.sleep(READ_TIMEOUT_S * 1.5)  # an idle kept-alive connection may close meanwhile
        second = http.get("/v1/models")

    assert first.status_code == second.status_code == 200


# --- many connections from one address ------------------------------------------------------------

FILES = 256
"""Descriptors the crowded server may open: a few hundred sockets reach it, as some thousand reach
the usual limit (1024 on many hosts), so the test needs few."""
FLOOD = 300
PER_ADDRESS = 64  # gym-serve's default --max-connections-per-address
HEALTH = b"GET /health HTTP/1.1\r\nHost: serve\r\n\r\n"


@pytest.fixture(scope="module")
def crowded(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`gym-serve` on v0000 with its defaults, allowed FILES descriptors."""
    root = tmp_path_factory.mktemp("crowded") / "models"
    shutil.copytree(tiny_home_template / "models", root)
    signer = Identity.load(tiny_home_template / "coordinator.key")
    served = start(root, signer, "--no-variants", files=FILES)
    try:
        yield served
    finally:
        stop(served.proc)


def status_line(sock: socket.socket, timeout_s: float) -> bytes:
    """The first line the server sent on `sock` within `timeout_s` (b"": none, or it closed)."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data and (chunk := sock.recv(4096)):
            data += chunk
    return data.partition(b"\r\n")[0]


def test_one_address_cannot_hold_every_connection(crowded: Server) -> None:
    address = urlsplit(crowded.url)
    target = (address.hostname or "", address.port or 0)
    flood = [socket.create_connection(target, timeout=5) for _ in range(FLOOD)]
    try:
        for sock in flood:  # whole requests, then the connections stay open (kept alive)
            sock.sendall(HEALTH)
        with socket.create_connection(target, timeout=5, source_address=("127.0.0.2", 0)) as other:
            other.sendall(HEALTH)
            served = status_line(other, timeout_s=3)
        answers = [status_line(sock, timeout_s=0.05) for sock in flood]
    finally:
        for sock in flood:
            sock.close()

    assert served == b"HTTP/1.1 200 OK"
    assert answers.count(b"HTTP/1.1 200 OK") == PER_ADDRESS
    assert answers.count(b"HTTP/1.1 503 Service Unavailable") == FLOOD - PER_ADDRESS
    warnings = [line for line in crowded.log.read_text().splitlines() if "refused" in line]
    assert len(warnings) == 1 and "from 127.0.0.1, which holds 64," in warnings[0]
