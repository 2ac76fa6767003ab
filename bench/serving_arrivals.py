"""What a running batch feels when requests for variants not yet in memory arrive.

    python bench/serving_arrivals.py --model qwen2.5-0.5b --rows 8 --arrivals 4

The serving engine (`zoo_gym.serving.engine.Engine`, as `gym-serve` runs it, its variant memory
at gym-serve's default) decodes --rows requests for the base model, greedy, each
--new-tokens long. After --warmup tokens, --arrivals requests for as many distinct variants
that no request has used yet (`bench/serving.py` writes them: random deltas of the base) arrive
together, --arrival-tokens tokens each; with --preread those variants are in memory already
(the steps then cost what the new rows' prefill and products add, and no read). Every token of the first base row is stamped as it is
sampled; the gaps between them are the steps its client sees. Printed, in milliseconds:

- the median gap before the arrivals (a step of the running batch alone);
- the longest gap from the arrivals until the last variant request has its first token (the
  running rows' worst pause while the variants are read);
- the median gap over that span, and how long after arriving the first and the last variant
  request had a first token.

The models are those of `bench/serving.py` (the tiny test model, or a randomly initialised
model with Qwen2.5-0.5B's configuration, float32 on the CPU) with a word-level tokenizer of
the model's vocabulary made here (`t0` .. `tN`; the text is not the point), and no end token:
every request runs to its length. The peak RSS is printed against the bytes of the variants
read.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from serving import BASE, build_base, write_variants  # bench/ is on the path of a bench script
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from zoo_gym.serving.engine import Delta, Engine, EngineLimits, Event, Sampling
from zoo_gym.serving.engine_models import DEFAULT_VARIANT_MEMORY, ServedModel, Weights
from zoo_gym.serving.variants import VariantStore, attach


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose tokens are `t0` .. `t{vocab_size - 1}` (`t0` pads)."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t0"
    )


def served(root: Path, variants: int) -> tuple[ServedModel, list[ServedModel], VariantStore]:
    """The base as gym-serve serves it (float32, hooked for variants within its default
    variant memory), and `variants` of its variants."""
    model = AutoModelForCausalLM.from_pretrained(root / BASE, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    store = VariantStore(root, BASE, DEFAULT_VARIANT_MEMORY)
    weights = Weights(model, torch.device("cpu"), attach(model, store).assign, store)
    tokenizer = word_tokenizer(model.config.vocab_size)
    base = ServedModel(BASE, root / BASE, 0, tokenizer, weights, context=4096)
    out = []
    for i in range(1, variants + 1):
        version = f"var{i:04d}"
        out.append(
            ServedModel(
                f"{version}-from-{BASE}",
                root / BASE,
                0,
                tokenizer,
                weights,
                context=4096,
                parent=BASE,
                variant=version,
            )
        )
    return base, out, store


class Stamps:
    """When each event of one request came (monotonic seconds)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.times.append(time.monotonic())
        else:
            self.ended.set()


def measure(args: argparse.Namespace) -> dict[str, float]:
    root = Path(args.workdir) / args.model / "models"
    build_base(args.model, root / BASE)
    write_variants(root, args.arrivals)
    base, variants, store = served(root, args.arrivals)
    vocab = len(base.tokenizer)
    prompt = torch.randint(4, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0))
    engine = Engine({m.id: m for m in (base, *variants)}, EngineLimits(max_batch=64))
    rows = [Stamps() for _ in range(args.rows)]
    arrivals = [Stamps() for _ in variants]
    if args.preread:
        for model in variants:
            store.get(str(model.variant))
    engine.start()
    try:
        for sink in rows:
            engine.submit(base, prompt.tolist(), Sampling(args.new_tokens, 0.0), sink)
        while len(rows[0].times) < args.warmup:
            time.sleep(0.005)
        arrived = time.monotonic()
        for model, sink in zip(variants, arrivals, strict=True):
            engine.submit(model, prompt.tolist(), Sampling(args.arrival_tokens, 0.0), sink)
        for sink in (*rows, *arrivals):
            sink.ended.wait(timeout=3600)
    finally:
        engine.stop()
    firsts = [sink.times[0] - arrived for sink in arrivals]
    stamps = rows[0].times
    gaps = list(itertools.pairwise(stamps))
    before = [b - a for a, b in gaps if b <= arrived]
    span = [b - a for a, b in gaps if b > arrived and a < arrived + max(firsts)]
    return {
        "step_ms": 1e3 * statistics.median(before[1:]),
        "longest_ms": 1e3 * max(span),
        "median_ms": 1e3 * statistics.median(span),
        "first_ms": 1e3 * min(firsts),
        "last_ms": 1e3 * max(firsts),
        "variants_mib": store.nbytes / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "qwen2.5-0.5b"], default="tiny")
    parser.add_argument("--rows", type=int, default=8, help="base requests running")
    parser.add_argument("--arrivals", type=int, default=4, help="variant requests arriving")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per base request")
    parser.add_argument("--warmup", type=int, default=8, help="base tokens before the arrivals")
    parser.add_argument("--arrival-tokens", type=int, default=4, help="tokens per variant one")
    parser.add_argument("--preread", action="store_true", help="variants in memory before")
    parser.add_argument("--workdir", default="/tmp/zoo-serving-bench", help="models, variants")
    args = parser.parse_args()
    figures: dict[str, Any] = measure(args)
    print(
        f"{args.model}: {args.rows} base rows running, {args.arrivals} variants arriving"
        f"{' (read before)' if args.preread else ''}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "| step ms (before) | longest gap ms | median gap ms | first variant token ms | "
        "last variant token ms | variants read MiB | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {figures['step_ms']:.0f} | {figures['longest_ms']:.0f} | {figures['median_ms']:.0f} "
        f"| {figures['first_ms']:.0f} | {figures['last_ms']:.0f} | "
        f"{figures['variants_mib']:.0f} | {figures['peak_rss_mib']:.0f} |"
    )


if __name__ == "__main__":
    main()
