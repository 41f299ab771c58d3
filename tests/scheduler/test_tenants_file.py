"""--tenants-file: a valid file gives each named tenant its limits and every other the defaults;
a wrong one is refused with a TenantsFileError that names the file and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_service.core.tenants import (
    DEFAULT_TENANT,
    TenantLimits,
    TenantsFileError,
    TenantTable,
    check_tenant_name,
    load_tenants_file,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_a_valid_file() -> None:
    path = Path(__file__).parent / "tenants_example.toml"
    table = load_tenants_file(path)
    assert table.source == path
    assert table.defaults == TenantLimits(weight=1.0, max_running=64)
    assert table.limits("acme") == TenantLimits(weight=4, max_running=32, max_waiting=100, tokens_per_minute=200000)
    assert table.limits("beta.team-2") == TenantLimits(weight=0.5)
    # Not named: the defaults, the default tenant included.
    assert table.limits("someone-else") == table.defaults == table.limits(DEFAULT_TENANT)


def test_an_empty_file_is_no_limits_at_all(tmp_path: Path) -> None:
    table = load_tenants_file(write(tmp_path, ""))
    assert table.limits("anyone") == TenantLimits() == TenantTable().limits("anyone")
    assert TenantLimits() == TenantLimits(weight=1.0, max_running=None, max_waiting=None, tokens_per_minute=None)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[limits]\nweight = 2\n", r"unknown tables \['limits'\]"),
        ("[tenants.acme]\nwieght = 2\n", r"\[tenants.acme\] has unknown keys \['wieght'\]"),
        ("[defaults]\nmax_inflight = 2\n", r"\[defaults\] has unknown keys \['max_inflight'\]"),
        ('[tenants.acme]\nweight = "heavy"\n', r"\[tenants.acme\] weight must be a number, got 'heavy'"),
        ("[tenants.acme]\nweight = true\n", r"weight must be a number, got True"),
        ("[tenants.acme]\nmax_running = 2.5\n", r"max_running must be a whole number, got 2.5"),
        ("[tenants.acme]\ntokens_per_minute = \"1k\"\n", r"tokens_per_minute must be a whole number"),
        ("[tenants.acme]\nweight = 0\n", r"\[tenants.acme\]: weight must be a positive number, got 0"),
        ("[tenants.acme]\nweight = -1.5\n", r"weight must be a positive number, got -1.5"),
        ("[tenants.acme]\nweight = inf\n", r"weight must be a positive number, got inf"),
        ("[tenants.acme]\nweight = nan\n", r"weight must be a positive number, got nan"),
        ("[tenants.acme]\nmax_running = 0\n", r"max_running must be at least 1, got 0"),
        ("[tenants.acme]\ntokens_per_minute = -5\n", r"tokens_per_minute must be at least 1, got -5"),
        ("[tenants.acme]\nmax_waiting = -1\n", r"max_waiting must not be negative, got -1"),
        ('[tenants."bad name"]\nweight = 1\n', r"tenant name 'bad name' must be 1-64 letters"),
        ('[tenants."-dash-first"]\n', r"tenant name '-dash-first'"),
        (f'[tenants.{"x" * 65}]\n', r"tenant name 'x{65}'"),
        ("tenants = 3\n", r"tenants must be a table of \[tenants.NAME\] tables"),
        ("defaults = 3\n", r"\[defaults\] must be a table"),
        ("[tenants]\nacme = 4\n", r"\[tenants.acme\] must be a table"),
        ("[tenants.acme\n", r"cannot read the tenants file"),
    ],
)
def test_a_wrong_file_is_refused_naming_the_problem(tmp_path: Path, text: str, problem: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TenantsFileError, match=problem) as refused:
        load_tenants_file(path)
    assert str(path) in str(refused.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="cannot read the tenants file"):
        load_tenants_file(tmp_path / "absent.toml")


def test_max_waiting_zero_is_allowed(tmp_path: Path) -> None:
    """No waiting at all: past max_running a request is refused at once."""
    table = load_tenants_file(write(tmp_path, "[tenants.acme]\nmax_running = 1\nmax_waiting = 0\n"))
    assert table.limits("acme").max_waiting == 0


@pytest.mark.parametrize("name", ["a", "Acme", "team.prod_1-eu", "9lives", "x" * 64])
def test_tenant_names_that_may_be_used(name: str) -> None:
    assert check_tenant_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "a b", "a/b", "ä", "x" * 65, "a\n", "a=b", 'a"'])
def test_tenant_names_that_may_not(name: str) -> None:
    with pytest.raises(ValueError, match="tenant name"):
        check_tenant_name(name)
