"""Variants of a served base in one batch, against the merged models P + decode(variant)."""

import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from zoo_gym.coordinator.registry import ModelRegistry
from zoo_gym.coordinator.variants import apply_variant, write_variant
from zoo_gym.core.identity import Identity
from zoo_gym.serving.engine import Delta, Done, Engine, EngineLimits, Event, Failed, Sampling
from zoo_gym.serving.engine_models import ServedModel, ServingError, load_models
from zoo_gym.serving.variants import (
    MixedModel,
    VariantError,
    VariantStore,
    attach,
    load_variant,
    variant_files,
)

VERSIONS = ("v0001", "v0002", "v0003")


@pytest.fixture(scope="module")
def models(tiny_home_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models root with v0000 and three variants of it, each written by `write_variant` from
    a child published as v0001 (the registry numbers children after their parent) and then
    renamed to its own version."""
    home = tmp_path_factory.mktemp("variants") / "coordinator"
    shutil.copytree(tiny_home_template, home)
    registry = ModelRegistry(home / "models", Identity.load(home / "coordinator.key"))
    base = registry.load_state_dict("v0000")
    for i, version in reversed(list(enumerate(VERSIONS))):
        gen = torch.Generator().manual_seed(i)
        child = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        registry.publish(
            child, parent="v0000", round_number=1, aggregator="fedavg", contributors=(), metrics={}
        )
        write_variant(registry, "v0001")
        envelope, record = variant_files(registry.root, "v0001", "v0000")
        if version != "v0001":
            body = json.loads(record.read_text())
            target, target_record = variant_files(registry.root, version, "v0000")
            envelope.rename(target)
            target_record.write_text(json.dumps({**body, "version": version}))
            record.unlink()
    return registry.root


def _model(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _merged(models: Path, version: str) -> torch.nn.Module:
    """The reference: the base model with P + decode(variant) loaded into it."""
    model = _model(models / "v0000")
    payload = variant_files(models, version, "v0000")[0].read_bytes()
    weights = apply_variant(dict(model.state_dict()), payload)
    model.load_state_dict(weights)
    return model


def test_a_mixed_batch_gives_each_row_its_merged_models_logits(models: Path) -> None:
    rows = [None, "v0002", "v0001", None, "v0003", "v0001"]
    ids = torch.randint(4, 300, (len(rows), 12), generator=torch.Generator().manual_seed(7))
    mixed = attach(_model(models / "v0000"), VariantStore(models, "v0000", 10**8))

    with torch.no_grad(), mixed.assign(rows):
        logits = mixed.model(ids).logits
    plain = mixed.model(ids).logits  # outside `assign`: the base alone

    base = _model(models / "v0000")
    with torch.no_grad():
        for r, version in enumerate(rows):
            reference = (base if version is None else _merged(models, version))(ids[r : r + 1])
            torch.testing.assert_close(logits[r], reference.logits[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(plain[r], base(ids[r : r + 1]).logits[0])
    assert not torch.allclose(logits[1], logits[0], atol=1e-2)  # the variants do change logits


def test_generate_with_a_kv_cache_matches_the_merged_models(models: Path) -> None:
    rows = ["v0003", None, "v0001", "v0002"]
    prompt = torch.randint(4, 300, (len(rows), 8), generator=torch.Generator().manual_seed(3))
    mixed = attach(_model(models / "v0000"), VariantStore(models, "v0000", 10**8))

    with torch.no_grad(), mixed.assign(rows):
        tokens = mixed.model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)

    for r, version in enumerate(rows):
        model = _model(models / "v0000") if version is None else _merged(models, version)
        with torch.no_grad():
            alone = model.generate(
                prompt[r : r + 1], max_new_tokens=10, do_sample=False, pad_token_id=0
            )
        n = alone.shape[1]  # a row alone stops at its end token; the batch pads it with 0
        assert torch.equal(tokens[r, :n], alone[0]) and not tokens[r, n:].any()


def test_the_torch_reference_gives_the_compiled_products(models: Path) -> None:
    from zoo_gym.serving import binary

    rows = ["v0001", None, "v0002"]
    ids = torch.randint(4, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    mixed = attach(_model(models / "v0000"), VariantStore(models, "v0000", 10**8))
    previous = binary.use_compiled(False)
    try:
        with torch.no_grad(), mixed.assign(rows):
            reference = mixed.model(ids).logits
    finally:
        binary.use_compiled(previous)
    with torch.no_grad(), mixed.assign(rows):
        compiled = mixed.model(ids).logits
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


def test_a_variant_is_kept_packed_at_about_one_fourteenth_of_bf16(models: Path) -> None:
    variant = load_variant(models, "v0001", base="v0000")
    base = _model(models / "v0000")

    matrices = {n: p.numel() for n, p in base.named_parameters() if p.dim() == 2}
    vectors = {n: p.numel() for n, p in base.named_parameters() if p.dim() == 1}
    sizes = [*matrices.values(), *vectors.values()]
    packed = sum(-(-n // 8) + 2 * -(-n // 128) for n in sizes)  # signs, fp16 scales
    assert set(variant.packed) == set(matrices) and set(variant.vectors) == set(vectors)
    kept = [*variant.packed.values(), *variant.vectors.values()]
    assert all(p.bits.dtype == torch.uint8 and p.scales.dtype == torch.float16 for p in kept)
    assert variant.nbytes == packed  # norms and biases packed as well
    assert variant.nbytes < 2 * sum(sizes) / 14  # 1.125 bits per value against bf16's 16
    assert variant.version == "v0001" and variant.parent == "v0000"


def test_missing_corrupt_and_foreign_variants_are_refused_with_one_line(
    models: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    shutil.copytree(models / "variants", root / "variants")

    with pytest.raises(VariantError, match="no variant v0009 of v0000"):
        load_variant(root, "v0009", base="v0000")
    with pytest.raises(VariantError, match="a delta of v0000, not of the served base v0002"):
        load_variant(root, "v0001", base="v0002")

    envelope = variant_files(root, "v0001", "v0000")[0]
    payload = bytearray(envelope.read_bytes())
    payload[100] ^= 1
    envelope.write_bytes(bytes(payload))
    replaced = "not the one expected: it is corrupted or was replaced; write the variant again"
    with pytest.raises(VariantError, match=replaced):
        load_variant(root, "v0001", base="v0000")
    shutil.copy(variant_files(root, "v0003", "v0000")[0], envelope)  # sound, but another's
    with pytest.raises(VariantError, match=replaced):
        load_variant(root, "v0001", base="v0000")
    envelope.write_bytes(bytes(payload[:-1]))
    with pytest.raises(VariantError, match="does not match its record"):
        load_variant(root, "v0001", base="v0000")

    body = json.loads(variant_files(root, "v0002", "v0000")[1].read_text())
    body["parent"] = "v0001"
    variant_files(root, "v0002", "v0000")[1].write_text(json.dumps(body))
    with pytest.raises(VariantError, match="describes v0002-from-v0001, not v0002-from-v0000"):
        load_variant(root, "v0002", base="v0000")


def test_a_batch_refuses_a_variant_of_another_shape_and_a_wrong_row_count(models: Path) -> None:
    variant = load_variant(models, "v0001", base="v0000")
    mixed = attach(_model(models / "v0000"))
    name = next(iter(variant.shapes))
    other = type(variant)(variant.version, "v0000", variant.packed, variant.vectors, {name: (1,)})

    with pytest.raises(VariantError, match="holds other tensors than the served model"):
        mixed.assign([other]).__enter__()
    with pytest.raises(VariantError, match="no store is attached"):
        mixed.assign(["v0001"]).__enter__()
    wrong_rows = pytest.raises(ValueError, match="the batch has 3 rows but assign was given 2")
    with torch.no_grad(), mixed.assign([variant, None]), wrong_rows:
        mixed.model(torch.ones(3, 4, dtype=torch.long))


def test_the_store_evicts_the_least_recently_used_within_its_budget(models: Path) -> None:
    size = load_variant(models, "v0001", base="v0000").nbytes
    store = VariantStore(models, "v0000", budget_bytes=2 * size + size // 2)

    first = store.get("v0001")
    store.get("v0002")
    assert store.get("v0001") is first  # a hit, and v0001 is now the most recent
    store.get("v0003")  # over budget: v0002, the least recently used, goes

    assert (store.hits, store.loads, store.evictions) == (1, 3, 1)
    assert "v0001" in store and "v0003" in store and "v0002" not in store
    assert store.nbytes == 2 * size <= store.budget_bytes
    assert store.fits(["v0001", "v0002"]) and store.fits(["v0004"])  # v0004: as large as any
    assert not store.fits(["v0001", "v0002", "v0003"]) and not store.fits(["v0004"] * 3)
    store.get("v0002")
    assert store.loads == 4 and "v0001" not in store

    with pytest.raises(VariantError, match="more than the budget"):
        VariantStore(models, "v0000", budget_bytes=size // 2).get("v0001")


def test_a_variant_that_failed_its_read_is_not_read_again_until_its_files_change(
    models: Path, tmp_path: Path
) -> None:
    """Asking again for a damaged variant answers from the failure (no second read of its
    file) until its retry time; once the variant is written again it is read."""
    root = tmp_path / "models"
    shutil.copytree(models / "variants", root / "variants")
    envelope = variant_files(root, "v0001", "v0000")[0]
    payload = envelope.read_bytes()
    envelope.write_bytes(payload[:100] + bytes([payload[100] ^ 1]) + payload[101:])
    store = VariantStore(root, "v0000", budget_bytes=10**8)

    for _ in range(3):
        with pytest.raises(VariantError, match="not the one expected"):
            store.get("v0001")
    assert store.snapshot()["failed_reads"] == 1
    store.retry_failed_s = 0.0
    with pytest.raises(VariantError, match="not the one expected"):
        store.get("v0001")  # the failure remembered ran out: read again (and kept again)
    assert store.snapshot()["failed_reads"] == 2

    staged = envelope.with_suffix(".part")
    staged.write_bytes(payload)
    staged.replace(envelope)  # as a writer replaces a file: another inode
    assert store.get("v0001").version == "v0001"
    assert (store.loads, store.snapshot()["failed_reads"]) == (1, 2)


def test_a_pinned_variant_stays_and_a_reservation_waits_for_room(models: Path) -> None:
    """Memory for two variants: pins beyond it are refused until one is released, and a read
    evicts the least recently used variant that is not pinned, not the one that is."""
    size = load_variant(models, "v0001", base="v0000").nbytes
    store = VariantStore(models, "v0000", budget_bytes=2 * size + size // 2)
    for version in VERSIONS:
        store.expect(version, size)  # as the server does from their records

    assert store.reserve("v0002") and store.reserve("v0001") and store.reserve("v0001")
    assert not store.reserve("v0003")  # a third does not fit beside the two pinned
    store.release("v0001")
    assert not store.reserve("v0003")  # v0001 is still pinned once
    store.release("v0001")
    assert store.reserve("v0003") and store.snapshot()["pinned"] == 2

    store.get("v0002")
    store.get("v0001")  # v0002 is now the least recently used, but pinned
    store.get("v0003")
    assert "v0002" in store and "v0003" in store and "v0001" not in store
    assert (store.loads, store.evictions, store.nbytes) == (3, 1, 2 * size)


def _count_runs(module: torch.nn.Module, runs: list[int]) -> None:
    forward = module.forward

    def counted(*args: object, **kwargs: object) -> object:
        runs.append(1)
        return forward(*args, **kwargs)

    module.forward = counted  # type: ignore[method-assign]


def _counted_norm(models: Path) -> tuple[MixedModel, torch.nn.Module, list[int]]:
    """The base with its store attached, its final norm, and a list that grows by one each
    time that norm's forward runs."""
    mixed = attach(_model(models / "v0000"), VariantStore(models, "v0000", 10**8))
    norm = mixed.model.model.norm
    runs: list[int] = []
    _count_runs(norm, runs)
    return mixed, norm, runs


def test_a_norm_runs_once_with_per_row_weights_after_the_first_step(models: Path) -> None:
    """The first forward of an `assign` runs a changed norm twice (its own weights, then the
    per-row ones, to learn that they broadcast); every later forward puts the per-row
    weights in ahead of the one run, and the module gets its own weights back after it."""
    rows = ["v0001", None, "v0002"]
    ids = torch.randint(4, 300, (3, 5), generator=torch.Generator().manual_seed(2))
    mixed, norm, runs = _counted_norm(models)
    own = norm.weight

    with torch.no_grad(), mixed.assign(rows):
        first = mixed.model(ids).logits
        assert len(runs) == 2
        second = mixed.model(ids).logits
        assert len(runs) == 3
        assert norm.weight is own

    torch.testing.assert_close(second, first)
    reference = _merged(models, "v0002")(ids[2:3]).logits[0]
    torch.testing.assert_close(second[2], reference, rtol=1e-4, atol=1e-4)


def test_a_norm_runs_once_in_every_later_assign(models: Path) -> None:
    """The serving engine enters an `assign` around each forward pass: what the first one
    learned (the norm's forward broadcasts per-row weights) holds in the next, whose first
    forward runs the norm once, for other rows and variants, and gives the merged logits."""
    ids = torch.randint(4, 300, (3, 5), generator=torch.Generator().manual_seed(2))
    mixed, norm, runs = _counted_norm(models)
    own = norm.weight

    with torch.no_grad():
        with mixed.assign(["v0001", None, "v0002"]):
            mixed.model(ids)
        assert len(runs) == 2
        with mixed.assign(["v0003", "v0001", None]):
            logits = mixed.model(ids).logits
        assert len(runs) == 3 and norm.weight is own

    reference = _merged(models, "v0003")(ids[0:1]).logits[0]
    torch.testing.assert_close(logits[0], reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[2], _model(models / "v0000")(ids[2:3]).logits[0])


def test_a_forward_that_fails_leaves_no_per_row_weights_behind(models: Path) -> None:
    rows = ["v0001", "v0002"]
    ids = torch.randint(4, 300, (2, 4), generator=torch.Generator().manual_seed(4))
    mixed = attach(_model(models / "v0000"), VariantStore(models, "v0000", 10**8))
    norms = [m for m in mixed.model.modules() if type(m).__name__.endswith("RMSNorm")]
    owns = [m.weight for m in norms]

    def fail(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError("stopped inside the model")

    with torch.no_grad(), mixed.assign(rows):
        mixed.model(ids)  # the plans are made: later forwards swap weights in ahead
        last = mixed.model.model.layers[-1].post_attention_layernorm
        handle = last.register_forward_pre_hook(fail)  # after the per-row weights went in
        with pytest.raises(RuntimeError, match="stopped inside"):
            mixed.model(ids)
        handle.remove()
    assert all(m.weight is own for m, own in zip(norms, owns, strict=True))
    with torch.no_grad():
        torch.testing.assert_close(mixed.model(ids).logits, _model(models / "v0000")(ids).logits)


def _answer(engine: Engine, models: list[ServedModel], max_tokens: int) -> dict[str, list[Event]]:
    """The events of one greedy request to each of `models`, submitted in order to `engine`,
    which is started here and stopped once all are answered."""
    ids = models[0].tokenizer("12 + 7 =")["input_ids"]
    ends: dict[str, list[Event]] = {model.id: [] for model in models}
    engine.start()
    try:
        for model in models:
            sampling = Sampling(max_tokens=max_tokens, temperature=0.0)
            engine.submit(model, ids, sampling, ends[model.id].append)
        deadline = time.monotonic() + 60
        while not all(e and not isinstance(e[-1], Delta) for e in ends.values()):
            assert time.monotonic() < deadline, "the requests were not answered"
            time.sleep(0.05)
    finally:
        engine.stop()
    return ends


def test_a_batch_holds_no_more_variants_than_the_memory_budget(models: Path) -> None:
    """Three requests for three variants at once, memory for two: the third waits for a row
    of the others to end instead of joining the batch, so no forward pass holds three
    variants and none is read again while its rows run; every request is answered."""
    size = load_variant(models, "v0001", base="v0000").nbytes
    served = load_models(models, variant_memory=2 * size + size // 2)
    base = served["v0000"]
    store = base.weights.store
    assert store is not None
    held: list[set[str]] = []
    assign = base.weights.assign

    def recording(rows: Sequence[str | None]) -> AbstractContextManager[Any]:
        held.append({r for r in rows if r is not None})
        return assign(rows)

    base.weights.assign = recording
    engine = Engine(served, EngineLimits(max_batch=8, batch_wait_s=0.5))  # all three at once
    assert store.loads == 0  # the start reads none
    names = [f"{v}-from-v0000" for v in VERSIONS]
    ends = _answer(engine, [served[name] for name in names], max_tokens=6)

    assert max(len(h) for h in held) == 2
    assert set().union(*held) == {v for v in VERSIONS}
    assert store.loads == 3  # each read once
    assert store.nbytes <= store.budget_bytes
    assert all(isinstance(ends[name][-1], Done) for name in names)
    figures = engine.snapshot()["variants"]["v0000"]  # type: ignore[index]
    assert (figures["loaded"], figures["loads"], figures["pinned"]) == (2, store.loads, 0)


def test_a_variant_that_cannot_be_read_fails_its_request_alone(
    models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """v0001's file is damaged after the server started (memory for one variant): a request
    for it fails with one line naming no path, and the request running beside it on the
    base, and one for another variant after it, are answered."""
    root = tmp_path / "models"
    shutil.copytree(models, root)
    size = load_variant(root, "v0001", base="v0000").nbytes
    served = load_models(root, variant_memory=size + size // 2)
    envelope = variant_files(root, "v0001", "v0000")[0]
    envelope.write_bytes(envelope.read_bytes()[:-1] + b"\0")
    engine = Engine(served, EngineLimits(max_batch=8))
    names = ("v0000", "v0001-from-v0000", "v0003-from-v0000")
    ends = _answer(engine, [served[name] for name in names], max_tokens=24)

    failed = ends["v0001-from-v0000"][-1]
    assert isinstance(failed, Failed)
    assert failed.message == (
        "the variant v0001-from-v0000 cannot be read on this server now; its log says why"
    )
    assert isinstance(ends["v0000"][-1], Done) and isinstance(ends["v0003-from-v0000"][-1], Done)
    assert "not the one expected" in caplog.text and str(envelope) in caplog.text
    store = served["v0000"].weights.store
    assert store is not None and store.snapshot()["pinned"] == 0  # the failed one's too


def test_the_server_starts_without_reading_a_variant_and_refuses_a_truncated_one(
    models: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    shutil.copytree(models, root)
    served = load_models(root)
    store = served["v0000"].weights.store
    assert store is not None and (store.loads, len(store)) == (0, 0)
    size = json.loads(variant_files(root, "v0001", "v0000")[1].read_text())["size"]
    most = store.budget_bytes // size  # unread variants are taken at their records' sizes
    assert store.fits(["v0001"] * most) and not store.fits(["v0001"] * (most + 1))

    envelope = variant_files(root, "v0002", "v0000")[0]
    envelope.write_bytes(envelope.read_bytes()[:-1])
    with pytest.raises(ServingError, match=r"v0002-from-v0000.zgde is \d+ bytes; its record says"):
        load_models(root)


def _greedy_text(model: torch.nn.Module, tokenizer: Any, ids: list[int], n: int) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def _until(events: list[Event], seconds: float) -> bool:
    """Whether `events` ended (a `Done` or `Failed`) within `seconds`."""
    deadline = time.monotonic() + seconds
    while not (events and not isinstance(events[-1], Delta)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _piped(models: Path, tmp_path: Path) -> tuple[dict[str, ServedModel], threading.Thread]:
    """The variants of `models`, served after v0001's file became a pipe that nobody writes
    to yet (its read waits), and the thread that writes its bytes into it once started."""
    root = tmp_path / "models"
    shutil.copytree(models, root)
    served = load_models(root)
    envelope = variant_files(root, "v0001", "v0000")[0]
    payload = envelope.read_bytes()
    envelope.unlink()
    os.mkfifo(envelope)
    return served, threading.Thread(target=envelope.write_bytes, args=(payload,), daemon=True)


def test_the_batch_decodes_while_a_variant_is_read(models: Path, tmp_path: Path) -> None:
    """A variant whose file is slow to read (a pipe nobody writes to yet) holds up no one: a
    request for the base sent after it is answered in full meanwhile, and the variant's
    request is answered as its merged model once the bytes arrive."""
    served, writer = _piped(models, tmp_path)
    base, variant = served["v0000"], served["v0001-from-v0000"]
    ids = base.tokenizer("12 + 7 =")["input_ids"]
    answers: dict[str, list[Event]] = {"variant": [], "base": []}
    engine = Engine(served, EngineLimits(max_batch=8))
    engine.start()
    try:
        engine.submit(
            variant, ids, Sampling(max_tokens=6, temperature=0.0), answers["variant"].append
        )
        engine.submit(base, ids, Sampling(max_tokens=6, temperature=0.0), answers["base"].append)
        base_answered = _until(answers["base"], 30)
        variant_before = list(answers["variant"])
        writer.start()
        variant_answered = _until(answers["variant"], 30)
    finally:
        if writer.ident is None:
            writer.start()  # the read ends, and the reader with it
        engine.stop()

    assert base_answered and isinstance(answers["base"][-1], Done)
    assert variant_before == []  # nothing of it while its bytes were missing
    assert variant_answered and isinstance(answers["variant"][-1], Done)
    text = "".join(e.text for e in answers["variant"] if isinstance(e, Delta))
    assert text == _greedy_text(_merged(models, "v0001"), base.tokenizer, ids, 6)
    assert base.weights.store is not None and base.weights.store.snapshot()["pinned"] == 0


def test_a_request_cancelled_or_stopped_during_its_variants_read_unpins_it(
    models: Path, tmp_path: Path
) -> None:
    """One request's client goes away while its variant is read, another's server stops: the
    first hears nothing, the second that the server stopped before it started, and the
    stop does not wait for the read; neither leaves its variant pinned."""
    served, writer = _piped(models, tmp_path)
    variant = served["v0001-from-v0000"]
    store = variant.weights.store
    assert store is not None
    ids = variant.tokenizer("12 + 7 =")["input_ids"]
    gone: list[Event] = []
    stopped: list[Event] = []
    engine = Engine(served, EngineLimits(max_batch=8))
    engine.start()
    try:
        first = engine.submit(variant, ids, Sampling(max_tokens=4, temperature=0.0), gone.append)
        engine.submit(variant, ids, Sampling(max_tokens=4, temperature=0.0), stopped.append)
        deadline = time.monotonic() + 30
        while engine.snapshot()["reading_variants"] != 2:
            assert time.monotonic() < deadline, "the requests were not admitted"
            time.sleep(0.02)
        first.cancel()
        assert store.snapshot()["pinned"] == 1  # one variant, for both requests
        began = time.monotonic()
        engine.stop()
        took = time.monotonic() - began
    finally:
        writer.start()  # the read ends, and the reader with it

    assert took < 5
    assert gone == [] and stopped == [Failed("the server stopped before this request started")]
    assert store.snapshot()["pinned"] == 0
