"""A contributor that misbehaves on purpose: for demos, end-to-end tests and red-team drills.

`gym-client join --byzantine ATTACK` turns this process into an attacker of the
federation it joins. Two kinds of attack are available to a lone process:

- data attacks poison its own records before training: `label_flip` gives examples
  the answer of another example, `random_completion` replaces answers by random text;
- update attacks replace its trained update by an attack computed from that update
  alone (a lone attacker sees no other contributor's update): `sign_flip` sends
  -scale * u, `scaling` sends boost * (-u) (model replacement), `ipm` sends
  -epsilon * u and `gaussian` sends N(0, sigma^2) noise.

The omniscient, colluding attacks (ALIE, min-max, min-sum, mimic) need every honest
update of the round; `gym-sim run` plays them on the coordinator's side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoo_gym.attacks import ATTACKS, poison_records
from zoo_gym.core.chat import Conversation
from zoo_gym.core.delta import Delta, flatten, layout_of, unflatten

DATA_ATTACKS = ("label_flip", "random_completion")
LONE_UPDATE_ATTACKS = ("sign_flip", "scaling", "ipm", "gaussian")
BYZANTINE_ATTACKS = DATA_ATTACKS + LONE_UPDATE_ATTACKS
#: model replacement needs a boost; a lone attacker does not know n, so it assumes ten contributors
DEFAULT_PARAMS: dict[str, dict[str, float]] = {"scaling": {"boost": 10.0}}


@dataclass(frozen=True)
class Misbehaviour:
    attack: str
    params: dict[str, float] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.attack not in BYZANTINE_ATTACKS:
            raise ValueError(
                f"unknown attack {self.attack!r}; choose one of {', '.join(BYZANTINE_ATTACKS)}"
            )

    def poison(self, conversations: list[Conversation]) -> list[Conversation]:
        """The conversations this attacker trains on: poisoned for a data attack, else unchanged."""
        if self.attack not in DATA_ATTACKS:
            return conversations
        answers = [{"instruction": "", "input": "", "output": _answer(c)} for c in conversations]
        poisoned = poison_records(
            answers, kind=self.attack, generator=torch.Generator().manual_seed(self.seed)
        )
        return [_with_answer(c, r["output"]) for c, r in zip(conversations, poisoned, strict=True)]

    def corrupt(self, update: Delta, round_number: int) -> Delta:
        """The update this attacker sends instead of `update` (unchanged for a data attack)."""
        if self.attack not in LONE_UPDATE_ATTACKS:
            return update
        layout = layout_of(update)
        own = flatten(update, layout).unsqueeze(0)  # (1, d)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round_number)
        params = {**DEFAULT_PARAMS.get(self.attack, {}), **self.params}
        row = ATTACKS[self.attack](own, num_byzantine=1, f=1, generator=generator, **params)[0]
        return unflatten(row.to(torch.float32), layout)


def _answer(conversation: Conversation) -> str:
    return next(t["content"] for t in reversed(conversation) if t["role"] == "assistant")


def _with_answer(conversation: Conversation, answer: str) -> Conversation:
    last = max(i for i, t in enumerate(conversation) if t["role"] == "assistant")
    return [{**t, "content": answer} if i == last else dict(t) for i, t in enumerate(conversation)]
