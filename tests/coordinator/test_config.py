"""Coordinator config: the aggregation policy is checked when it is loaded, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo_gym.coordinator.config import ConfigError, load_config


def _write(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "coordinator.toml"
    path.write_text(text)
    return path


def test_rule_parameters_and_pre_aggregation_are_loaded(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        'aggregator = "multikrum"\nbyzantine_f = 1\nmin_clients = 5\n'
        'pre_aggregation = "nnm"\n[aggregator_params]\nm = 2\n',
    )
    config = load_config(path)
    assert (config.aggregator, config.aggregator_params, config.pre) == (
        "multikrum",
        {"m": 2},
        "nnm",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'aggregator = "krum"\nbyzantine_f = 2\nmin_clients = 5\n',
            "krum with byzantine_f = 2 needs at least 7 updates per round; set min_clients >= 7 or lower byzantine_f",
        ),
        (
            'aggregator = "bulyan"\nbyzantine_f = 1\nmin_clients = 6\n',
            "bulyan with byzantine_f = 1 needs at least 7",
        ),
        ('pre_aggregation = "mix"\n', "pre_aggregation must be none or nnm, not 'mix'"),
        (
            'aggregator = "centered_clipping"\nmin_clients = 3\n[aggregator_params]\ntau = -1.0\n',
            "tau must be > 0",
        ),
        (
            'aggregator = "median"\n[aggregator_params]\ntau = 1.0\n',
            "median does not take parameter(s) 'tau'",
        ),
        (
            '[rewards]\nmethod = "vibes"\n',
            "rewards: method must be none or one of individual, leave_one_out",
        ),
        (
            '[rewards]\npool = "10.0000005"\n',
            "pool 10.0000005 is not a whole number of units of 0.000001",
        ),
        ("[rewards]\npool = -1\n", "rewards.pool: Input should be greater than or equal to 0"),
        (
            'admission = "invite"\nrequire_approval = true\n',
            'require_approval = true contradicts admission = "invite"; remove require_approval',
        ),
        ('admission = "closed"\n', "admission: Input should be 'open', 'approval' or 'invite'"),
    ],
)
def test_bad_aggregation_policy_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, text))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_network_open_to_strangers_is_robust_by_default(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, ""))
    assert (config.admission, config.aggregator, config.byzantine_f) == ("open", "median", 0)
    assert config.trusted_reputation > 0 and config.registration_rate_per_s > 0


def test_require_approval_in_an_old_config_means_approval(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "require_approval = true\n"))
    assert config.admission == "approval"


def test_the_environment_names_the_ledger_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, 'database_url = "sqlite:///from-file.db"\n')
    assert load_config(path).ledger_url == "sqlite:///from-file.db"

    monkeypatch.setenv("ZOO_GYM_DATABASE_URL", "postgresql+psycopg://zoo:secret@db/zoo")

    assert load_config(path).ledger_url == "postgresql+psycopg://zoo:secret@db/zoo"


def test_a_file_can_hold_the_ledger_database_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, 'database_url = "sqlite:///from-file.db"\n')
    secret = tmp_path / "database_url"
    secret.write_text("postgresql+psycopg://zoo:s3cret@postgres:5432/zoo_gym\n")
    monkeypatch.setenv("ZOO_GYM_DATABASE_URL_FILE", str(secret))

    assert load_config(path).ledger_url == "postgresql+psycopg://zoo:s3cret@postgres:5432/zoo_gym"
    monkeypatch.setenv("ZOO_GYM_DATABASE_URL", "sqlite:///from-env.db")  # the variable wins
    assert load_config(path).ledger_url == "sqlite:///from-env.db"
    monkeypatch.delenv("ZOO_GYM_DATABASE_URL")

    secret.write_text("\n")
    with pytest.raises(ConfigError, match=r"database_url is empty; write the database URL in it"):
        load_config(path)
    secret.unlink()
    with pytest.raises(ConfigError) as missing:
        load_config(path)
    assert "cannot be read (No such file or directory)" in str(missing.value)
    assert "\n" not in str(missing.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [("", 5 * 10**9), ("shard_size = 1048576\n", 1 << 20), ('shard_size = "2GB"\n', 2 * 10**9)],
)
def test_shard_size_takes_bytes_or_a_unit(tmp_path: Path, text: str, size: int) -> None:
    assert load_config(_write(tmp_path, text)).shard_size == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('shard_size = "2 parsecs"\n', "shard_size: '2 parsecs' is not a size; write bytes"),
        ("shard_size = 0\n", "shard_size: Input should be greater than or equal to 1"),
    ],
)
def test_a_bad_shard_size_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, text))
    assert message in str(exc.value) and "\n" not in str(exc.value)
