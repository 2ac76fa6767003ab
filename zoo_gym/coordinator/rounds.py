"""The round loop: one long, linear program run as a Flower ServerApp.

Per round: open it in the ledger, send the task to the sampled contributors,
collect signed submissions until every one answered or the deadline passed,
aggregate what intake accepted, merge the aggregate into the base, check the
quality gate on the private validation set, and publish a new signed version
or record the round as rolled back. An operator's abort, or the coordinator
stopping (collection ends at once when serve closes the mailbox), records the
round as aborted with the reason, before or after aggregation; nothing is paid
or published. The loop reports what it does to `co.health` (`/health`).

`RoundLoop` drives the parts a `Coordinator` is made of; the helpers beside it take only the
parts they use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from zoo_gym import ledger
from zoo_gym.compression import CodecSpec, carry_spec, honest_norm_bound
from zoo_gym.coordinator.config import CoordinatorConfig, TrainingPolicy
from zoo_gym.coordinator.control import Request, RoundControl
from zoo_gym.coordinator.evaluation import Evaluator
from zoo_gym.coordinator.intake import OpenRound
from zoo_gym.coordinator.liveness import LoopHealth
from zoo_gym.coordinator.payout import RoundScorer, pay_round
from zoo_gym.coordinator.service import Coordinator
from zoo_gym.coordinator.strategy import RoundAggregate
from zoo_gym.core.delta import Layout, TensorSpec
from zoo_gym.core.lora import (
    LoraSpec,
    for_base,
    is_carry,
    linear_layers_of,
    merge_update,
    module_of,
    update_shapes,
)
from zoo_gym.core.phases import phase
from zoo_gym.core.protocol import POLICY_OBJECTIVES, TASK_CONFIG, TaskConfig
from zoo_gym.ledger import Engine, Session
from zoo_gym.scoring import Quality
from zoo_gym.transport.flower_internals import set_task_identity

log = logging.getLogger(__name__)
SERVERAPP_NODE_ID = 0
STOPPING = "coordinator stopping"
"""The reason recorded on a round that was open when serve was asked to stop."""


@dataclass(frozen=True)
class RoundSummary:
    round: int
    base_version: str
    status: str
    published_version: str
    participants: int
    received: int
    accepted: int
    rejected: int
    aggregated: int
    loss_before: float
    loss_after: float
    seconds: float
    reward_before: float | None = None  # GRPO / GSPO: mean validation reward of the base
    mean_reward: float | None = None  # GRPO / GSPO: mean validation reward of the candidate
    # what scoring the contributions cost ("" and 0 when the round was not scored)
    scoring_method: str = ""  # the method whose scores were paid
    scoring_fallback_from: str = ""  # the method that ran out of scoring_seconds, if one did
    scoring_evaluations: int = 0
    scoring_backward_passes: int = 0
    scoring_seconds: float = 0.0


def round_seed(run_seed: int, round_number: int) -> int:
    """The seed of round `round_number`: its data order and sampling on every client."""
    digest = hashlib.sha256(f"zoo-gym/round-seed|{run_seed}|{round_number}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def a_seed(run_seed: int, round_number: int, a_rounds: int) -> int:
    """The seed every client generates round `round_number`'s frozen LoRA A from: the
    `round_seed` of the first round of its epoch, rounds 1..K, K+1..2K, ... for
    ``a_rounds`` = K (with K = 1, the round's own seed)."""
    first = round_number - (round_number - 1) % a_rounds
    return round_seed(run_seed, first)


def carry_a_seed(run_seed: int, round_number: int, a_rounds: int) -> int | None:
    """The `a_seed` of the previous epoch of A when round `round_number` opens a new one after
    the first (its FFA updates then carry each client's residual for that A as a second B);
    None in every other round."""
    if round_number <= 1 or (round_number - 1) % a_rounds:
        return None
    return a_seed(run_seed, round_number - 1, a_rounds)


def lora_spec(t: TrainingPolicy) -> LoraSpec:
    return LoraSpec(rank=t.lora_rank, alpha=t.lora_alpha, target_modules=tuple(t.target_modules))


def update_layout(
    state: dict[str, torch.Tensor],
    spec: LoraSpec,
    adapter: str = "ffa_lora",
    *,
    carry: bool = False,
) -> Layout:
    """Names and shapes of the tensors a round's update consists of: the B matrices for
    ffa_lora (and, with `carry`, the carried Bs for the previous A), the target weights for
    lora / dora / qlora, every floating weight for full."""
    shapes = update_shapes(state, adapter=adapter, spec=spec, carry=carry)
    return tuple(TensorSpec(name, shape) for name, shape in sorted(shapes.items()))


def touched_weights(update: dict[str, torch.Tensor], adapter: str) -> list[str]:
    """The base weights merging `update` changes: each B's module weight for ffa_lora, the
    update's own names otherwise."""
    if adapter == "ffa_lora":
        return sorted({module_of(key) + ".weight" for key in update})
    return sorted(update)


def merge_candidate(
    weights: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    update: dict[str, torch.Tensor],
    *,
    adapter: str,
    spec: LoraSpec,
    seed: int,
    carry_seed: int | None = None,
) -> list[str]:
    """Merge `update` into the evaluator's `weights` (with `state` loaded), in place, as
    `merge_update` would merge it into `state` (carried Bs with the A of `carry_seed`): each
    changed weight rounded to its stored dtype. Returns the names of the changed weights."""
    merge_update(weights, update, adapter=adapter, spec=spec, seed=seed, carry_seed=carry_seed)
    names = touched_weights(update, adapter)
    with torch.no_grad():
        for name in names:
            if state[name].dtype != weights[name].dtype:
                weights[name].copy_(weights[name].to(state[name].dtype))
    return names


def validation_reward(
    evaluator: Evaluator, t: TrainingPolicy, state: dict[str, torch.Tensor] | None
) -> float | None:
    """Mean reward of greedy completions on the validation prompts for GRPO / GSPO (of the
    evaluator's weights as they stand when `state` is None); None for SFT."""
    if t.method not in POLICY_OBJECTIVES:
        return None
    return evaluator.mean_reward(
        state, reward_functions=t.reward_functions, max_new_tokens=t.max_new_tokens
    )


def round_epsilon(engine: Engine, round_number: int, contributors: tuple[str, ...]) -> float | None:
    """The largest per-round sample-level epsilon the round's aggregated contributors reported
    (None when one of them reported none: that update carries no DP guarantee).

    It bounds what this round added about any one record; a contributor's total over rounds
    is in its reward report and its own `gym-client status`.
    """
    with Session(engine) as session:
        subs = ledger.list_submissions(session, round_number=round_number)
    spent = {s.contributor_id: s.epsilon for s in subs if s.decision == "accepted"}
    values = [spent.get(c) for c in contributors]
    if not values or any(v is None for v in values):
        return None
    return max(v for v in values if v is not None)


def update_norm_bound(config: CoordinatorConfig, layout: Layout) -> float:
    """The largest L2 norm intake accepts for a decoded update of `layout` (0.0: no bound).

    With ``training.clip_norm`` C set, `zoo_gym.compression.honest_norm_bound`: every honest
    update (clipped to C, Gaussian noise of std ``update_noise_multiplier * C`` per value,
    error-feedback residual capped at `FEEDBACK_HEADROOM` times that, then compressed with the
    task's codec, its carried Bs with the carry codec) is below it. Without a clip norm, the
    ``max_update_norm`` setting.
    """
    t = config.training
    if t.clip_norm <= 0:
        return config.max_update_norm
    spec = CodecSpec(codec=t.codec, group_size=t.group_size, granularity=t.granularity)
    carried = carry_spec(spec, t.carry_codec)
    own = {ts.name: carried for ts in layout if is_carry(ts.name)}
    return honest_norm_bound(
        spec, layout, clip_norm=t.clip_norm, noise_multiplier=t.update_noise_multiplier, own=own
    )


def abort_request(
    control: RoundControl, stop: threading.Event, round_number: int
) -> Request | None:
    """An operator's abort of round `round_number`, or the coordinator's own while it stops."""
    request = control.abort_requested(round_number)
    if request is None and stop.is_set():
        request = Request("coordinator", STOPPING)
    return request


def nobody_came(c: CoordinatorConfig, stop: threading.Event, health: LoopHealth, done: int) -> bool:
    """No contributors connected in time: True when the loop ends for it.

    With `rounds = 0` (run until stopped) the loop waits again; with `rounds = N` it ends, and
    says so in the log and on `/health`.
    """
    if stop.is_set():
        return True
    waited = (
        f"no contributors connected within {c.wait_for_clients_s:.0f} s "
        f"(min_clients = {c.min_clients})"
    )
    if c.rounds == 0:
        log.warning("%s; waiting again", waited)
        return False
    reason = (
        f"{waited}; {done} of {c.rounds} rounds ran "
        "(start contributors sooner or raise wait_for_clients_s)"
    )
    log.warning("%s; stopping", reason)
    health.set("stopped", reason)
    return True


@dataclass
class Opened:
    """A round whose tasks are out: what its close needs to know."""

    number: int
    seed: int
    a_seed: int  # of the frozen LoRA A the round's B updates are merged with
    carry_a_seed: int | None  # of the previous A, merged with the carried Bs (None: no carry)
    base_version: str
    messages: list[Message]
    started: float


@dataclass
class Outcome:
    """How a round ended: its status, the version it published and the candidate's scores."""

    status: str
    loss: float
    reward: float | None
    published: str = ""
    scoring: Quality | None = None  # the contributions' quality and what it cost


class RoundLoop:
    """The state the round loop carries from round to round: the current base (weights,
    validation loss and reward), the update layout (the open round's: with the carried Bs in
    the first round of an epoch of A) and the strategy, which a policy change staged through
    the REST API rebuilds."""

    def __init__(self, co: Coordinator, grid: Grid) -> None:
        self.co, self.grid = co, grid
        self.base = co.registry.latest()
        with phase("load", f"base {self.base.version}"):
            self.state = co.registry.load_state_dict(self.base.version)
        with phase("evaluate", f"base {self.base.version}"):
            self.loss = co.evaluator.loss(self.state)
        self.linear = linear_layers_of(self.base.directory)  # and which are stored (in, out)
        self._configure()

    def _configure(self) -> None:
        """Layout, strategy and the base's validation reward under the current policy (the
        reward method, and so the utility, may have changed)."""
        self.config = self.co.config
        t = self.config.training
        self.spec = for_base(lora_spec(t), self.linear, adapter=t.adapter)
        self.layout = update_layout(self.state, self.spec, t.adapter)
        self.strategy = self.co.make_strategy(self._round_layout)
        self.reward = validation_reward(self.co.evaluator, self.config.training, self.state)

    def _round_layout(self) -> Layout:
        return self.layout

    def run(self, on_round: Callable[[RoundSummary], None] | None = None) -> None:
        co = self.co
        done, number = 0, first_round(co.engine)
        log.info(
            "starting at round %d on %s (validation loss %.4f)",
            number,
            self.base.version,
            self.loss,
        )
        while not co.stop.is_set() and (self.config.rounds == 0 or done < self.config.rounds):
            if not co.control.wait_until_runnable(co.stop):  # an operator holds rounds paused
                break
            self._take_policy()
            opened = self._open(number)
            if opened is None:
                if nobody_came(self.config, co.stop, co.health, done):
                    break
                continue
            replies = list(
                self.grid.send_and_receive(opened.messages, timeout=self.config.round_timeout_s)
            )
            assert co.backend.open_round is not None
            co.backend.open_round.accepting = False
            summary = self._close(opened, *self._conclude(opened, replies))
            if on_round is not None:
                on_round(summary)
            done += 1
            number += 1
        if not co.stop.is_set() and self.config.rounds > 0 and done >= self.config.rounds:
            co.health.set("finished", f"{done} rounds done")

    def _take_policy(self) -> None:
        """Apply a policy change staged through the REST API, from this round on."""
        change = self.co.control.take_policy()
        if change is not None:
            self.co.apply_policy(change.config)
            self._configure()
            log.info("policy changed by %s: %s", change.by, ", ".join(sorted(change.changes)))

    def _open(self, number: int) -> Opened | None:
        """Wait for contributors and send them the round's task; None when nobody came."""
        co, config, t = self.co, self.config, self.config.training
        started = time.perf_counter()
        co.health.set("waiting")
        seed = round_seed(config.seed, number)
        carry = carry_a_seed(config.seed, number, t.lora_a_rounds)
        if t.adapter != "ffa_lora":
            carry = None
        self.layout = update_layout(self.state, self.spec, t.adapter, carry=carry is not None)
        task = TaskConfig(
            round=number,
            base_version=self.base.version,
            seed=seed,
            a_seed=a_seed(config.seed, number, t.lora_a_rounds),
            carry_a_seed=-1 if carry is None else carry,
            deadline_ms=int((time.time() + config.round_timeout_s) * 1000),
            **t.task_fields(),
        )
        messages = list(
            self.strategy.configure_train(
                number, ArrayRecord(), ConfigRecord(task.to_record()), self.grid
            )
        )
        if not messages:
            return None
        co.health.set("running")
        with Session(co.engine) as session:
            ledger.open_round(
                session,
                number=number,
                base_version=self.base.version,
                seed=seed,
                aggregator=config.aggregator,
                codec=t.codec,
            )
        co.control.round_started(number)
        co.metrics.round_opened(number)
        # configure_train waited for contributors to connect: the deadline runs from when tasks go out
        deadline_ms = int((time.time() + config.round_timeout_s) * 1000)
        for message in messages:
            message.content.config_records[TASK_CONFIG]["deadline_ms"] = deadline_ms
        co.backend.open_round = OpenRound(
            number,
            self.base.version,
            self.layout,
            deadline_ms,
            codec=t.codec,
            carry_codec=t.carry_codec,
            max_update_norm=update_norm_bound(config, self.layout),
        )
        return Opened(number, seed, task.a_seed, carry, self.base.version, messages, started)

    def _conclude(
        self, opened: Opened, replies: list[Message]
    ) -> tuple[Outcome, RoundAggregate | None, Request | None]:
        """Aggregate the replies unless the round is aborted (before or during aggregation);
        then pay, merge and check the quality gate."""
        co = self.co
        abort = abort_request(co.control, co.stop, opened.number)
        aggregation_started = time.perf_counter()
        agg = None if abort else self.strategy.aggregate_round(opened.number, replies)
        if not abort:
            co.metrics.observe_aggregation(time.perf_counter() - aggregation_started)
        abort = abort or abort_request(co.control, co.stop, opened.number)  # stopped meanwhile
        if abort or agg is None or not agg.update:
            return Outcome("aborted", self.loss, self.reward), agg, abort
        return self._judge(opened, agg), agg, None

    def _judge(self, opened: Opened, agg: RoundAggregate) -> Outcome:
        """Pay the contributions, merge the aggregate into the base and publish the candidate
        if it passes the quality gate; otherwise the round is rolled back."""
        co, config = self.co, self.config
        loss, reward = self.loss, self.reward
        detail = f"round {opened.number}"
        with phase("score", detail):
            scoring = self._score(opened, agg)
        # the candidate, in the evaluation model's weights: the ones the update touches are
        # loaded from the base (the others hold it already; a rolled-back candidate is undone)
        touched = touched_weights(agg.update, config.training.adapter)
        with co.evaluator.editing({n: self.state[n] for n in touched}) as weights:
            with phase("merge", detail):
                names = merge_candidate(
                    weights,
                    self.state,
                    agg.update,
                    adapter=config.training.adapter,
                    spec=self.spec,
                    seed=opened.a_seed,
                    carry_seed=opened.carry_a_seed,
                )
            with phase("evaluate", detail):
                new_loss = co.evaluator.loss(None)
                new_reward = validation_reward(co.evaluator, config.training, None)
            if not self._passes(new_loss, new_reward):
                with torch.no_grad():
                    for name in names:
                        weights[name].copy_(self.state[name])
                return Outcome("rolled_back", new_loss, new_reward, scoring=scoring)
            with torch.no_grad():  # the base becomes the candidate
                for name in names:
                    self.state[name].copy_(weights[name])
        metrics = {"validation_loss": new_loss, "parent_validation_loss": loss}
        if reward is not None and new_reward is not None:
            metrics.update(mean_reward=new_reward, parent_mean_reward=reward)
        with phase("publish", detail):
            published = self._publish(opened.number, agg.contributors, metrics)
        return Outcome("published", new_loss, new_reward, published, scoring)

    def _score(self, opened: Opened, agg: RoundAggregate) -> Quality | None:
        """Score and pay the contributions (`pay_round`) on the round's validation subset,
        within its time budget; the quality and its cost, counted in the metrics."""
        co, config = self.co, self.config
        scorer = RoundScorer(
            co.evaluator,
            config.training,
            self.state,
            self.layout,
            self.spec,
            seed=opened.a_seed,
            carry_seed=opened.carry_a_seed,
            subset_seed=opened.seed,
            examples=config.rewards.scoring_examples,
            baseline=-self.loss if self.reward is None else self.reward,
        )
        paid = pay_round(co.engine, config, round_number=opened.number, agg=agg, scorer=scorer)
        if paid is None:
            return None
        quality = paid[1]
        co.metrics.observe_scoring(
            quality.seconds,
            evaluations=quality.utility_calls,
            backward_passes=quality.backward_passes,
            fell_back=bool(quality.fallback_from),
        )
        return quality

    def _passes(self, new_loss: float, new_reward: float | None) -> bool:
        """The quality gate: the candidate is no worse than the base by more than the tolerance."""
        tolerance, loss, reward = self.config.quality_gate_tolerance, self.loss, self.reward
        if reward is None or new_reward is None:
            return new_loss <= loss * (1.0 + tolerance)
        # rewards may be 0 or negative: the tolerance is relative to max(|reward|, 1)
        return new_reward >= reward - tolerance * max(abs(reward), 1.0)

    def _publish(
        self, number: int, contributors: tuple[str, ...], metrics: dict[str, float]
    ) -> str:
        """Sign and store the base weights (the candidate, merged into them) as the new base
        version and record it; its version. If that fails, the weights are read back from the
        parent version before the error goes on."""
        co, parent = self.co, self.base.version
        try:
            pub = co.registry.publish(
                self.state,
                parent=parent,
                round_number=number,
                aggregator=self.config.aggregator,
                contributors=contributors,
                metrics=metrics,
                epsilon=round_epsilon(co.engine, number, contributors),
                shard_size=self.config.shard_size,
            )
            with Session(co.engine) as session:
                ledger.record_model_version(
                    session,
                    version=pub.version,
                    parent=parent,
                    round_number=number,
                    manifest_sha256=hashlib.sha256(pub.manifest.to_bytes()).hexdigest(),
                    path=str(pub.directory),
                    metrics=metrics,
                )
        except BaseException:
            self.state = co.registry.load_state_dict(parent)
            raise
        self.base = pub
        return pub.version

    def _close(
        self, opened: Opened, outcome: Outcome, agg: RoundAggregate | None, abort: Request | None
    ) -> RoundSummary:
        """Record the round's end (ledger row and signed checkpoint, metrics, rounds.jsonl)."""
        co = self.co
        received = agg.received if agg else 0
        accepted = agg.accepted if agg else 0
        summary = RoundSummary(
            round=opened.number,
            base_version=opened.base_version,
            status=outcome.status,
            published_version=outcome.published,
            participants=len(opened.messages),
            received=received,
            accepted=accepted,
            rejected=received - accepted,
            aggregated=len(agg.contributors) if agg else 0,
            loss_before=self.loss,
            loss_after=outcome.loss,
            seconds=time.perf_counter() - opened.started,
            reward_before=self.reward,
            mean_reward=outcome.reward,
            **scoring_cost(outcome.scoring),
        )
        closing: dict[str, object] = dict(asdict(summary))
        if abort:
            closing.update(aborted_by=abort.by, reason=abort.reason)
        with Session(co.engine) as session:
            ledger.close_round(
                session,
                number=opened.number,
                status=outcome.status,
                new_version=outcome.published or None,
                metrics=closing,
                signer=co.signer,  # the checkpoint contributors verify their rewards against
            )
            co.checkpoints.copy_checkpoint(ledger.latest_checkpoint(session))
        co.metrics.observe_round(opened.number, summary.seconds, status=outcome.status)
        co.control.round_finished(opened.number)
        if outcome.status == "published":
            self.loss, self.reward = outcome.loss, outcome.reward
        co.backend.open_round = None
        with co.config.path("rounds.jsonl").open("a") as fh:
            fh.write(json.dumps(asdict(summary)) + "\n")
        log.info(
            "round %d %s: %d/%d accepted, loss %.4f -> %.4f%s",
            opened.number,
            outcome.status,
            accepted,
            received,
            summary.loss_before,
            outcome.loss,
            f", published {outcome.published}" if outcome.published else "",
        )
        return summary


def scoring_cost(quality: Quality | None) -> dict[str, Any]:
    """The `RoundSummary` fields that say what scoring a round cost (none when not scored)."""
    if quality is None:
        return {}
    return {
        "scoring_method": quality.method,
        "scoring_fallback_from": quality.fallback_from,
        "scoring_evaluations": quality.utility_calls,
        "scoring_backward_passes": quality.backward_passes,
        "scoring_seconds": quality.seconds,
    }


def first_round(engine: Engine) -> int:
    """The number of the next round; a round a restart left open is recorded aborted."""
    with Session(engine) as session:
        last = ledger.latest_round(session)
        if last is not None and last.status in ("open", "aggregating"):
            ledger.close_round(
                session,
                number=last.number,
                status="aborted",
                metrics={"reason": "coordinator restarted during the round"},
            )
    return 1 if last is None else last.number + 1


def run_rounds(
    co: Coordinator, grid: Grid, *, on_round: Callable[[RoundSummary], None] | None = None
) -> None:
    RoundLoop(co, grid).run(on_round)


def make_server_app(
    co: Coordinator, *, on_round: Callable[[RoundSummary], None] | None = None
) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_rounds(co, grid, on_round=on_round)

    return app


def run_server_app(
    co: Coordinator, grid: Grid, *, on_round: Callable[[RoundSummary], None] | None = None
) -> None:
    """Run the round loop as a ServerApp on `grid` in this thread, outside Flower's runners
    (`serve` and the in-process federation)."""
    set_task_identity(run_id=1, node_id=SERVERAPP_NODE_ID, task_id=1)
    context = Context(
        run_id=1, node_id=SERVERAPP_NODE_ID, node_config={}, state=RecordDict(), run_config={}
    )
    make_server_app(co, on_round=on_round)(grid, context)
