import pytest
import torch

from zoo_gym.privacy.noise import add_gaussian_noise, secure_generator


def test_noise_has_the_requested_std() -> None:
    delta = {"a": torch.zeros(200_000), "b": torch.full((10,), 3.0, dtype=torch.bfloat16)}

    noisy = add_gaussian_noise(delta, std=0.5, generator=secure_generator())

    assert float(noisy["a"].std()) == pytest.approx(0.5, rel=0.01)
    assert abs(float(noisy["a"].mean())) < 0.01
    assert noisy["b"].dtype == torch.bfloat16
    assert torch.equal(delta["a"], torch.zeros(200_000))


def test_generators_are_unpredictable() -> None:
    draws = [torch.randn(4, generator=secure_generator()) for _ in range(2)]

    assert not torch.equal(draws[0], draws[1])


def test_zero_std_is_identity_and_negative_is_rejected() -> None:
    delta = {"a": torch.arange(3.0)}

    assert torch.equal(
        add_gaussian_noise(delta, std=0.0, generator=secure_generator())["a"], delta["a"]
    )
    with pytest.raises(ValueError):
        add_gaussian_noise(delta, std=-1.0, generator=secure_generator())


def test_generator_seed_is_drawn_from_the_os_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    import secrets

    draws: list[int] = []

    def randbits(k: int) -> int:
        draws.append(k)
        return 0x5EED_5EED

    monkeypatch.setattr(secrets, "randbits", randbits)

    generator = secure_generator()

    assert draws == [63] and generator.initial_seed() == 0x5EED_5EED


def test_noise_on_a_clipped_update_has_std_multiplier_times_norm() -> None:
    # the update-level Gaussian mechanism: clip to C = 0.5, then std = z * C with z = 2
    from zoo_gym.privacy.clip import clip_delta

    clipped, _ = clip_delta({"a": torch.full((100_000,), 1.0)}, 0.5)

    noisy = add_gaussian_noise(clipped, std=2.0 * 0.5, generator=secure_generator())

    assert float((noisy["a"] - clipped["a"]).std()) == pytest.approx(1.0, rel=0.02)
