import torch

from zoo_gym.compression import CodecSpec, ErrorFeedback, decode, encode

SPEC = CodecSpec("bitdelta", group_size=8)


def _rounds(seed: int, rounds: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    drift = torch.linspace(-0.05, 0.2, 64)  # a steady direction that sign quantisation distorts
    return [{"w": drift + 0.1 * torch.randn(64, generator=gen)} for _ in range(rounds)]


def test_error_feedback_tracks_sum_of_true_deltas() -> None:
    feedback = ErrorFeedback()
    true_sum = torch.zeros(64)
    sent_sum = torch.zeros(64)
    gaps = []

    for delta in _rounds(0, 200):
        _, transmitted = feedback.compress(delta, SPEC)
        true_sum += delta["w"]
        sent_sum += transmitted["w"]
        gaps.append(float((true_sum - sent_sum).norm()))

    assert torch.allclose(true_sum - sent_sum, feedback.residual["w"], atol=1e-4)
    assert max(gaps[100:]) < 2.0 * max(gaps[:100]) + 1e-6  # bounded, not growing
    assert gaps[-1] < 0.02 * float(true_sum.norm())


def test_without_error_feedback_one_bit_drifts() -> None:
    true_sum = torch.zeros(64)
    sent_sum = torch.zeros(64)

    for delta in _rounds(0, 200):
        true_sum += delta["w"]
        sent_sum += decode(encode(delta, SPEC), max_elements=64)["w"]

    feedback = ErrorFeedback()
    for delta in _rounds(0, 200):
        feedback.compress(delta, SPEC)
    drift = float((true_sum - sent_sum).norm())
    assert drift > 10 * float(feedback.residual["w"].norm())
    assert drift > 0.1 * float(true_sum.norm())


def test_transmitted_is_what_the_coordinator_decodes() -> None:
    feedback = ErrorFeedback()
    delta = {"w": torch.randn(10, 3)}

    payload, transmitted = feedback.compress(delta, SPEC)

    assert torch.equal(decode(payload, max_elements=30)["w"], transmitted["w"])


def test_state_dict_round_trip() -> None:
    first = ErrorFeedback()
    rounds = _rounds(1, 3)
    for delta in rounds[:2]:
        first.compress(delta, SPEC)
    second = ErrorFeedback()

    second.load_state_dict(first.state_dict())

    a, _ = first.compress(rounds[2], SPEC)
    b, _ = second.compress(rounds[2], SPEC)
    assert a == b
    assert torch.equal(first.residual["w"], second.residual["w"])
