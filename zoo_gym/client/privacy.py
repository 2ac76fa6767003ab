"""A contributor's privacy: the plan for each round, the account across rounds, the budget.

Two guarantees are tracked, each against the same threat model: an adversary who
sees every update this contributor submits (the coordinator, anyone who reads its
storage or the wire, and through the published models every other contributor and
the public), knows the training code and the task, and may know every other record.
The adversary does not see the contributor's machine: its data, its error-feedback
residual and its noise generator (seeded from the OS CSPRNG) stay local.

**Sample-level** (record-level) DP protects any one of the contributor's records:
an update computed with or without it is hard to tell apart. DP-SGD gives it
[Abadi et al., 2016]: per-example clipping to ``dp_max_grad_norm``, Gaussian noise
of std ``sigma * dp_max_grad_norm`` per step, Poisson sampling at rate
``q = batch_size / records``. One round is the history entry ``(sigma, q, steps)``.
A round without DP-SGD but with update noise still protects each record through
the Gaussian mechanism on the update (below), and is accounted as that.

**User-level** (local) DP protects the contributor's whole dataset at once: the
update is clipped to ``clip_norm`` C and Gaussian noise of std
``update_noise_multiplier * C`` is added on the contributor's machine before
compression. Two datasets of one contributor give clipped updates at most 2C apart,
so a round is the Gaussian entry ``(z / 2, 1, 1)``. DP-SGD alone gives no useful
user-level guarantee.

Totals compose every round's mechanisms with the task's Opacus accountant (RDP or
PRV) over the persisted history; the naive sum of per-round epsilons is kept too,
as the loose bound basic composition gives. A round released without any DP makes
the total unbounded (``None``) from then on. Compression, error feedback and the
coordinator's aggregation are post-processing and do not change these numbers.

Budget: with ``privacy_budget_epsilon`` set, the client computes the sample-level
total the round *would* bring (at the budget's delta) before training and refuses
the round when it exceeds the budget: nothing is trained, nothing is submitted and
`gym-client join` stops with one line (it does not wait for cheaper rounds: every
later round would only add to the total).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

from zoo_gym.client.errors import RoundRefusal
from zoo_gym.core.protocol import TaskConfig

if TYPE_CHECKING:
    from zoo_gym.privacy.accounting import Accountant, Mechanism

DP_SGD_OBJECTIVES = ("sft", "grpo", "gspo")  # GRPO / GSPO: a prompt is the record


class PrivacyRefusal(RoundRefusal):
    """The client will not train this round: over budget, or a privacy setting it cannot honour."""


@dataclass(frozen=True)
class PrivacyBudget:
    """The most sample-level epsilon the contributor allows in total, at `delta` (None: the task's)."""

    epsilon: float
    delta: float | None = None


@dataclass
class RoundSpend:
    """What one round spent; epsilons at `delta` with `accountant` (None: not private)."""

    round: int
    base_version: str
    delta: float
    accountant: str
    dp_noise_multiplier: float
    dp_max_grad_norm: float
    sample_rate: float
    steps: int
    update_noise_multiplier: float
    clip_norm: float
    epsilon: float | None
    epsilon_total: float | None
    user_epsilon: float | None
    user_epsilon_total: float | None


@dataclass
class PrivacyAccount:
    """Every mechanism this contributor's data went through, in order (persisted in local state).

    `sample_history` / `user_history` are Opacus accountant histories; `*_unbounded`
    is set once a round released an update without that kind of DP.
    """

    sample_history: list[Mechanism] = field(default_factory=list)
    user_history: list[Mechanism] = field(default_factory=list)
    sample_unbounded: bool = False
    user_unbounded: bool = False
    naive_epsilon_sum: float = 0.0
    rounds: list[RoundSpend] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrivacyAccount:
        def history(key: str) -> list[Mechanism]:
            return [(float(s), float(q), int(t)) for s, q, t in data.get(key, [])]

        return cls(
            sample_history=history("sample_history"),
            user_history=history("user_history"),
            sample_unbounded=bool(data.get("sample_unbounded", False)),
            user_unbounded=bool(data.get("user_unbounded", False)),
            naive_epsilon_sum=float(data.get("naive_epsilon_sum", 0.0)),
            rounds=[RoundSpend(**r) for r in data.get("rounds", [])],
        )

    def total(self, delta: float, accountant: str = "rdp") -> float | None:
        """Sample-level epsilon of everything so far (None: unbounded)."""
        return _compose(self.sample_history, self.sample_unbounded, delta, accountant)

    def user_total(self, delta: float, accountant: str = "rdp") -> float | None:
        """User-level epsilon of everything so far (None: unbounded)."""
        return _compose(self.user_history, self.user_unbounded, delta, accountant)

    def commit(self, plan: PrivacyPlan) -> None:
        """Add a round that was trained (its update left, or may leave, the machine)."""
        self.sample_history.extend(plan.sample_mechanisms)
        self.user_history.extend(plan.user_mechanisms)
        self.sample_unbounded |= not plan.sample_mechanisms
        self.user_unbounded |= not plan.user_mechanisms
        if plan.epsilon is not None:
            self.naive_epsilon_sum += plan.epsilon
        self.rounds.append(plan.spend)


@dataclass(frozen=True)
class PrivacyPlan:
    """How one round is privatized and what it costs (epsilons at `delta`; None: not private)."""

    round: int
    delta: float
    accountant: str
    dp_noise_multiplier: float  # DP-SGD sigma; 0 = no DP-SGD
    dp_max_grad_norm: float
    sample_rate: float
    steps: int
    update_noise_multiplier: float
    clip_norm: float
    sample_mechanisms: tuple[Mechanism, ...]
    user_mechanisms: tuple[Mechanism, ...]
    epsilon: float | None  # sample-level, this round
    epsilon_total: float | None  # sample-level, all rounds including this one
    user_epsilon: float | None
    user_epsilon_total: float | None
    base_version: str = ""

    @property
    def dp_sgd(self) -> bool:
        return self.dp_noise_multiplier > 0

    @property
    def update_noise_std(self) -> float:
        return self.update_noise_multiplier * self.clip_norm

    @property
    def spend(self) -> RoundSpend:
        """What the state file keeps of this plan: every `RoundSpend` field, read off the plan."""
        return RoundSpend(**{f.name: getattr(self, f.name) for f in fields(RoundSpend)})

    def metrics(self) -> dict[str, float]:
        """The submission's privacy metrics; an epsilon is absent when the round is not private."""
        out = {
            "dp_noise_multiplier": self.dp_noise_multiplier,
            "dp_max_grad_norm": self.dp_max_grad_norm if self.dp_sgd else 0.0,
            "dp_sample_rate": self.sample_rate if self.dp_sgd else 0.0,
            "dp_steps": float(self.steps if self.dp_sgd else 0),
            "dp_delta": self.delta,
            "dp_accountant_prv": 1.0 if self.accountant == "prv" else 0.0,
            "update_noise_multiplier": self.update_noise_multiplier,
            "clip_norm": self.clip_norm,
        }
        named = {
            "epsilon": self.epsilon,
            "epsilon_total": self.epsilon_total,
            "user_epsilon": self.user_epsilon,
            "user_epsilon_total": self.user_epsilon_total,
        }
        out.update({k: v for k, v in named.items() if v is not None})
        return out


def plan_round(
    task: TaskConfig,
    *,
    num_records: int,
    account: PrivacyAccount,
    budget: PrivacyBudget | None = None,
) -> PrivacyPlan:
    """Pick sigma, compute this round's and the running epsilons, and check the budget.

    Raises `PrivacyRefusal` (one line) when the round must not run.
    """
    _check_task(task, num_records)
    sample_rate = min(1.0, task.batch_size / num_records)
    sigma = _dp_sgd_sigma(task, sample_rate, num_records)
    user = _update_noise_mechanisms(task)
    sample: tuple[Mechanism, ...] = ((sigma, sample_rate, task.steps),) if sigma > 0 else user
    accountant, delta = task.dp_accountant, task.dp_delta
    plan = PrivacyPlan(
        round=task.round,
        delta=delta,
        accountant=accountant,
        dp_noise_multiplier=sigma,
        dp_max_grad_norm=task.dp_max_grad_norm,
        sample_rate=sample_rate,
        steps=task.steps,
        update_noise_multiplier=task.update_noise_multiplier,
        clip_norm=task.clip_norm,
        sample_mechanisms=sample,
        user_mechanisms=user,
        epsilon=_compose(sample, not sample, delta, accountant),
        epsilon_total=_compose(
            [*account.sample_history, *sample],
            account.sample_unbounded or not sample,
            delta,
            accountant,
        ),
        user_epsilon=_compose(user, not user, delta, accountant),
        user_epsilon_total=_compose(
            [*account.user_history, *user], account.user_unbounded or not user, delta, accountant
        ),
        base_version=task.base_version,
    )
    if budget is not None:
        check_budget(plan, account, budget)
    return plan


def _check_task(task: TaskConfig, num_records: int) -> None:
    """Raise `PrivacyRefusal` when the task asks for privacy this client cannot give."""
    from zoo_gym.privacy.accounting import ACCOUNTANTS

    if task.dp_accountant not in ACCOUNTANTS:
        raise PrivacyRefusal(
            f"round {task.round}: unknown accountant {task.dp_accountant!r} in the task; "
            "the coordinator must set dp_accountant to rdp or prv"
        )
    wants_dp_sgd = task.dp_target_epsilon > 0 or task.dp_noise_multiplier > 0
    if wants_dp_sgd and task.method not in DP_SGD_OBJECTIVES:
        raise PrivacyRefusal(
            f"round {task.round}: the task asks for DP-SGD, which this client implements only for "
            f"{', '.join(DP_SGD_OBJECTIVES)}, not {task.method}; the operator can use update noise "
            "(update_noise_multiplier) instead"
        )
    if task.update_noise_multiplier > 0 and task.clip_norm <= 0:
        raise PrivacyRefusal(
            f"round {task.round}: the task asks for update noise without clip_norm; "
            "the noise is scaled to the clipping norm, so the operator must set clip_norm > 0"
        )
    if num_records < 1:
        raise PrivacyRefusal("no local records to train on")


def _update_noise_mechanisms(task: TaskConfig) -> tuple[Mechanism, ...]:
    """The user-level Gaussian mechanism of the task's update noise (none without it)."""
    from zoo_gym.privacy.accounting import gaussian_update_mechanism

    if task.update_noise_multiplier <= 0:
        return ()
    return (gaussian_update_mechanism(task.update_noise_multiplier),)


def _dp_sgd_sigma(task: TaskConfig, sample_rate: float, num_records: int) -> float:
    """DP-SGD's noise multiplier: the task's, or the least that reaches its target epsilon."""
    from zoo_gym.privacy.accounting import noise_for_epsilon

    if task.dp_target_epsilon <= 0:
        return task.dp_noise_multiplier
    try:
        return noise_for_epsilon(
            task.dp_target_epsilon,
            sample_rate,
            task.steps,
            task.dp_delta,
            _name(task.dp_accountant),
        )
    except ValueError:
        raise PrivacyRefusal(
            f"round {task.round}: no noise level reaches epsilon {task.dp_target_epsilon:g} with "
            f"{num_records} records in {task.steps} steps; bring more data or ask for a larger epsilon"
        ) from None


def check_budget(plan: PrivacyPlan, account: PrivacyAccount, budget: PrivacyBudget) -> None:
    """Raise `PrivacyRefusal` when `plan` would take the sample-level total past `budget`."""
    delta = budget.delta if budget.delta is not None else plan.delta
    if account.sample_unbounded:
        done = ", ".join(str(r.round) for r in account.rounds if r.epsilon is None) or "earlier"
        raise PrivacyRefusal(
            f"privacy budget: round(s) {done} released updates without DP, so your records' total "
            "epsilon is unbounded and no budget can hold; use other data or remove privacy_budget_epsilon"
        )
    if not plan.sample_mechanisms:
        raise PrivacyRefusal(
            f"privacy budget: round {plan.round} trains without differential privacy (no DP-SGD, no update "
            f"noise), which your budget of epsilon {budget.epsilon:g} does not allow; not training"
        )
    total = (
        plan.epsilon_total  # the same composition, already done by plan_round
        if delta == plan.delta
        else _compose(
            [*account.sample_history, *plan.sample_mechanisms], False, delta, plan.accountant
        )
    )
    assert total is not None
    if total > budget.epsilon:
        spent = _compose(account.sample_history, False, delta, plan.accountant) or 0.0
        raise PrivacyRefusal(
            f"privacy budget: round {plan.round} would bring your epsilon to {total:.3f} (spent {spent:.3f}) "
            f"past your budget of {budget.epsilon:g} at delta {delta:g}; not training or submitting "
            "(raise privacy_budget_epsilon in client.toml to go on)"
        )


def _name(accountant: str) -> Accountant:
    return cast("Accountant", accountant)  # checked by plan_round; accounting refuses others


def _compose(history: Any, unbounded: bool, delta: float, accountant: str) -> float | None:
    from zoo_gym.privacy.accounting import epsilon_of_history

    if unbounded:
        return None
    value = epsilon_of_history(list(history), delta, _name(accountant))
    return value if math.isfinite(value) else None


__all__ = [
    "PrivacyAccount",
    "PrivacyBudget",
    "PrivacyPlan",
    "PrivacyRefusal",
    "RoundSpend",
    "check_budget",
    "plan_round",
]
