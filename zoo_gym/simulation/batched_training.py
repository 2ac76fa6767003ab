"""FFA-LoRA training of many virtual contributors at once, on one shared base model.

What `zoo_gym.client.trainers.sft.FfaLoraTrainer.train_round` does for one contributor,
done for a group of g contributors in one forward and one backward per step:

- the base model is loaded once and frozen; every target linear layer gets the round's
  frozen A `(r, in)` (`frozen_a`, the same for every contributor) and a stack of Bs
  `(g, out, r)`, one per contributor, starting at zero;
- a step takes, for each contributor, the next batch of its own `length_bucketed_batches`
  (its record lengths, a generator seeded with the round seed, as on a real client) and
  lays the batches out contributor by contributor: rows ``c * rows .. (c + 1) * rows`` are
  contributor c's (a contributor with a short batch gets rows of padding that carry no
  label), so each target layer computes ``W x + s * B_c (A x)`` with one batched matmul;
- contributor c's loss is the token mean of the next-token NLL over the labelled tokens of
  its own batch (`zoo_gym.core.chat.token_nll`; the last layer's queries, output
  projection and MLP and the head run at the labelled positions only, see
  `BatchedFfaLora._losses`); the
  sum over contributors is backpropagated, so each B_c receives exactly the gradient of its
  own loss;
- AdamW (weight decay 0) steps all the Bs: it is elementwise, so one optimiser over the
  stack is g independent ones.

The update of contributor c is its B per target module, keyed ``"<module>.lora_B"``, as
`FfaLoraTrainer.update` returns it. Right-padding to the group's widest batch changes no
labelled position's output (causal attention, padding on the right), so losses and updates match
the per-contributor trainer up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.llama import modeling_llama

from zoo_gym.client.trainers.sft import length_bucketed_batches
from zoo_gym.core.chat import IGNORE_INDEX
from zoo_gym.core.delta import Delta
from zoo_gym.core.lora import LoraSpec, frozen_a, linear_layers, target_weights, update_key
from zoo_gym.simulation.sweep import SweepError

_rotate_half: Callable[[Tensor], Tensor] = modeling_llama.rotate_half
"""The rotary embedding's partner of each value, as Llama-style decoders apply it."""


class BatchedEngineError(SweepError):
    """What the batched engine cannot train (one line, naming the engine to use instead)."""


class GroupedLora(nn.Module):
    """A frozen linear layer plus one LoRA B per contributor of a group:
    ``y = W x + s * B_c (A x)`` for the rows of contributor c (peft's order: A, then B)."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float) -> None:
        super().__init__()
        self.base = base
        self.scaling = scaling
        self.a = torch.zeros((rank, base.in_features))  # (r, in), shared
        self.b = torch.zeros((1, base.out_features, rank))  # (g, out, r), one per contributor

    def forward(self, x: Tensor) -> Tensor:  # x (g * rows, t, in)
        y = self.base(x)  # (g * rows, t, out)
        g = self.b.shape[0]
        xa = nn.functional.linear(x, self.a).reshape(g, -1, self.a.shape[0])  # (g, rows * t, r)
        out = torch.baddbmm(  # W x + s * B_c (A x), (g, rows * t, out)
            y.reshape(g, -1, y.shape[-1]), xa, self.b.transpose(1, 2), alpha=self.scaling
        )
        return out.reshape(y.shape)


@dataclass(frozen=True)
class Records:
    """One contributor's tokenised records: ids and labels `(n, width)` padded, and lengths."""

    ids: Tensor
    labels: Tensor
    lengths: list[int]

    @classmethod
    def of(cls, examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Records:
        width = max(len(ids) for ids, _ in examples)
        ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        for row, (tokens, labs) in enumerate(examples):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            labels[row, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        return cls(ids, labels, [len(t) for t, _ in examples])


@dataclass(frozen=True)
class GroupResult:
    """What one contributor's round produced, as `RoundResult` has it."""

    update: Delta
    mean_loss: float
    tokens: int
    num_examples: int


class BatchedFfaLora:
    """One frozen base model whose target layers train a stack of Bs, one per contributor."""

    def __init__(self, model: PreTrainedModel, *, spec: LoraSpec, pad_id: int) -> None:
        transposed = sorted(n for n, t in linear_layers(model).items() if t)
        self.shapes = target_weights(model, spec)  # module -> (out, in)
        if any(name in self.shapes for name in transposed):
            raise BatchedEngineError(
                "the batched engine trains nn.Linear targets only; this base stores some "
                "(in, out) (Conv1D): use the inprocess engine"
            )
        model.requires_grad_(False)
        self.model, self.spec, self.pad_id = model, spec, pad_id
        head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
        assert isinstance(head, nn.Module)
        self.decoder: Any = model.base_model  # Llama-style: embed_tokens, layers, norm, ...
        self.head = head
        check_decoder(self.decoder)
        self.layers: dict[str, GroupedLora] = {}
        for name in sorted(self.shapes):
            parent, _, leaf = name.rpartition(".")
            base = model.get_submodule(name)
            assert isinstance(base, nn.Linear)
            layer = GroupedLora(base, spec.rank, spec.scaling)
            setattr(model.get_submodule(parent), leaf, layer)
            self.layers[name] = layer

    def load_base(self, state_dict: dict[str, Tensor]) -> None:
        """Copy a published base version into the shared model, in place."""
        params = dict(self.model.named_parameters())
        renamed = {}
        for key in state_dict:
            module, _, leaf = key.rpartition(".")
            renamed[key] = f"{module}.base.{leaf}" if module in self.layers else key
        missing = sorted(set(params) - set(renamed.values()))
        unexpected = sorted(k for k, v in renamed.items() if v not in params)
        if missing or unexpected:
            raise ValueError(
                f"base state dict does not match the model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for key, name in renamed.items():
                params[name].copy_(state_dict[key])

    def train_group(
        self,
        records: Sequence[Records],
        *,
        seed: int,
        a_seed: int,
        steps: int,
        lr: float,
        batch_size: int,
    ) -> list[GroupResult]:
        """`steps` AdamW steps of every contributor in `records`, each on its own batches."""
        g = len(records)
        bs: list[Tensor] = []
        for name, layer in self.layers.items():
            out_features, in_features = self.shapes[name]
            layer.a = frozen_a(a_seed, name, in_features, self.spec.rank)
            layer.b = torch.zeros((g, out_features, self.spec.rank), requires_grad=True)
            bs.append(layer.b)
        optimizer = torch.optim.AdamW(bs, lr=lr, weight_decay=0.0)
        batches = [
            length_bucketed_batches(r.lengths, batch_size, torch.Generator().manual_seed(seed))
            for r in records
        ]
        store = _Store.of(records, self.pad_id)
        losses = torch.zeros((steps, g), dtype=torch.float64)
        tokens = [0] * g
        self.model.train()
        for step in range(steps):
            ids, labels, taken = self._step_batch(store, batches)
            optimizer.zero_grad(set_to_none=True)
            loss = self._losses(ids, labels, g)  # (g,)
            loss.sum().backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses[step] = loss.detach().double()
            tokens = [t + n for t, n in zip(tokens, taken, strict=True)]
        self.model.train(False)
        return [
            GroupResult(
                update={
                    update_key(name): layer.b[c].detach().clone()
                    for name, layer in self.layers.items()
                },
                mean_loss=float(losses[:, c].mean()),
                tokens=tokens[c],
                num_examples=len(records[c].lengths),
            )
            for c in range(g)
        ]

    def _step_batch(
        self, store: _Store, batches: Sequence[Iterator[list[int]]]
    ) -> tuple[Tensor, Tensor, list[int]]:
        """The step's rows, contributor by contributor: ids and labels `(g * rows, width)`,
        and the tokens of each contributor's batch."""
        picked = [next(b) for b in batches]
        rows = max(len(p) for p in picked)
        index = torch.tensor(
            [
                [store.offsets[c] + i for i in p] + [store.padding] * (rows - len(p))
                for c, p in enumerate(picked)
            ]
        )  # (g, rows): rows of the store
        lengths = store.lengths[index]  # (g, rows)
        real = index != store.padding
        width = int(lengths[real].max())
        index = index.flatten()
        taken = (lengths * real).sum(1).tolist()
        return store.ids[index, :width], store.labels[index, :width], taken

    def _losses(self, ids: Tensor, labels: Tensor, g: int) -> Tensor:
        """Each contributor's token-mean completion NLL `(g,)`.

        The decoder runs as the model's own forward does (embeddings, rotary position
        embeddings, every layer, final norm), with two shortcuts that leave the labelled
        positions' outputs as they are: no attention mask (padding is on the right, so under
        causal attention no labelled position sees it, and the causal kernel needs no
        `(rows, 1, t, t)` mask), and the last layer runs its queries, its output projection,
        its MLP, the final norm and the head only at the positions whose next token is labelled
        (a few of each row, `_Queries`): only its keys and values are needed everywhere.
        """
        d = self.decoder
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        h = d.embed_tokens(ids)
        rotary = d.rotary_emb(h, positions)
        context = {"attention_mask": None, "position_ids": positions, "position_embeddings": rotary}
        for layer in d.layers[:-1]:
            h = layer(h, **context)
        targets = labels[:, 1:]  # (g * rows, t - 1)
        labelled = targets != IGNORE_INDEX
        queries = _Queries.of(labelled)
        x = _last_layer(d.layers[-1], h, rotary, queries)  # (g * rows, most labelled, hidden)
        logits = self.head(d.norm(x[queries.real])).float()  # (tokens, vocab), row by row
        nll = nn.functional.cross_entropy(logits, targets[labelled], reduction="none")
        owner = labelled.nonzero()[:, 0] // (ids.shape[0] // g)  # contributor of each token
        sums = torch.zeros(g, dtype=nll.dtype).index_add(0, owner, nll)
        return sums / torch.bincount(owner, minlength=g).clamp(min=1)


@dataclass(frozen=True)
class _Queries:
    """The positions of each row whose next token is labelled, left-aligned in a
    `(rows, most)` table: `position[r, j]` is the j-th such position of row r (0 where
    `real[r, j]` is False: a slot the row does not fill, whose output is dropped)."""

    position: Tensor  # (rows, most) long
    real: Tensor  # (rows, most) bool

    @classmethod
    def of(cls, labelled: Tensor) -> _Queries:
        counts = labelled.sum(1)  # (rows,)
        most = max(int(counts.max()), 1)
        rows, where = labelled.nonzero(as_tuple=True)  # row-major: positions ascending
        slot = torch.arange(rows.shape[0]) - (torch.cumsum(counts, 0) - counts)[rows]
        position = torch.zeros((labelled.shape[0], most), dtype=torch.long)
        real = torch.zeros((labelled.shape[0], most), dtype=torch.bool)
        position[rows, slot] = where
        real[rows, slot] = True
        return cls(position, real)


def _last_layer(layer: Any, h: Tensor, rotary: tuple[Tensor, Tensor], queries: _Queries) -> Tensor:
    """A Llama-style decoder layer's output `(rows, most, hidden)` at `queries` only: keys
    and values from every position of `h` `(rows, t, hidden)`, each query attending to the
    positions up to its own (causal), then the output projection, the residual and the MLP.
    The rows stay contributor by contributor, as the stacked Bs need."""
    attn = layer.self_attn
    rows, most = queries.position.shape
    normed = layer.input_layernorm(h)
    at = queries.position.unsqueeze(-1)  # (rows, most, 1)
    residual = h.gather(1, at.expand(-1, -1, h.shape[-1]))  # (rows, most, hidden)
    q = attn.q_proj(normed.gather(1, at.expand(-1, -1, h.shape[-1])))
    q = q.view(rows, most, -1, attn.head_dim).transpose(1, 2)  # (rows, heads, most, dim)
    k = attn.k_proj(normed).view(rows, h.shape[1], -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(normed).view(rows, h.shape[1], -1, attn.head_dim).transpose(1, 2)
    cos, sin = rotary  # (1, t, dim)
    q_cos, q_sin = cos[0][queries.position].unsqueeze(1), sin[0][queries.position].unsqueeze(1)
    q = q * q_cos + _rotate_half(q) * q_sin
    k = k * cos.unsqueeze(1) + _rotate_half(k) * sin.unsqueeze(1)
    mask = torch.arange(h.shape[1]) <= at.unsqueeze(1)  # (rows, 1, most, t): causal
    out = nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    x: Tensor = residual + attn.o_proj(out.transpose(1, 2).reshape(rows, most, -1))
    mixed: Tensor = layer.mlp(layer.post_attention_layernorm(x))
    return x + mixed


def check_decoder(decoder: Any) -> None:
    """Refuse, in one line, a decoder that is not Llama-style (pre-norm layers of attention with
    q/k/v/o projections and a gate/up/down MLP, rotary positions, full attention), the kind
    `_losses` and `_last_layer` run."""
    layer = decoder.layers[-1] if hasattr(decoder, "layers") else None
    parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    if (
        layer is None
        or not all(hasattr(layer, p) for p in parts)
        or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        or not all(hasattr(attn, p) for p in projections)
        or hasattr(attn, "q_norm")  # normalised queries and keys (Qwen3): not Llama-style
        or not all(hasattr(decoder, p) for p in ("embed_tokens", "rotary_emb", "norm"))
        or getattr(decoder, "has_sliding_layers", False)
    ):
        raise BatchedEngineError(
            f"the batched engine trains Llama-style decoders (Qwen2, Llama), not "
            f"{type(decoder).__name__}: use the inprocess engine"
        )


@dataclass(frozen=True)
class _Store:
    """The records of a group in one table `(records + 1, width)`: contributor c's record i
    is row ``offsets[c] + i``; the last row (`padding`) is all padding and has no label."""

    ids: Tensor
    labels: Tensor
    lengths: Tensor  # (records + 1,)
    offsets: list[int]
    padding: int

    @classmethod
    def of(cls, records: Sequence[Records], pad_id: int) -> _Store:
        width = max(r.ids.shape[1] for r in records)
        total = sum(len(r.lengths) for r in records)
        ids = torch.full((total + 1, width), pad_id, dtype=torch.long)
        labels = torch.full((total + 1, width), IGNORE_INDEX, dtype=torch.long)
        lengths = torch.full((total + 1,), width, dtype=torch.long)
        offsets, row = [], 0
        for r in records:
            n, w = r.ids.shape
            ids[row : row + n, :w], labels[row : row + n, :w] = r.ids, r.labels
            lengths[row : row + n] = torch.tensor(r.lengths)
            offsets.append(row)
            row += n
        return cls(ids, labels, lengths, offsets, total)
