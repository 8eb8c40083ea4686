"""A configuration that does not validate, said so it can be fixed: the key, the file and line or
the environment variable, a close match for a typo; ranges refused where they are read; doctor
running the checks it can on a configuration that fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ember.config.errors import toml_lines
from ember.config.settings import Settings, load_settings
from ember.core.errors import ConfigError
from tests.test_cli_e2e import ember, ember_env, one_line

TYPOS = """\
agent_name = "Ember"
modle = "gpt-4o-mini"

[telegram]
tokn = "123:abc"

[models.fast]
provider = "openai"
bse_url = "http://127.0.0.1:9/v1"
model = "m"
"""


def write_config(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "ember.toml").write_text(text)
    return home / "ember.toml"


def test_typos_get_a_close_match_with_the_file_and_line(tmp_path: Path) -> None:
    file = write_config(tmp_path, TYPOS)

    done = ember(ember_env(tmp_path, None), "sessions", "list")

    assert done.returncode == 2
    said = one_line(done.stderr)
    assert "modle: not a setting Ember knows; did you mean `model`" in said and f"({file}, line 2)" in said
    assert f"telegram.tokn: not a setting Ember knows; did you mean `token`? ({file}, line 5)" in said
    assert f"models.fast.bse_url: not a setting Ember knows; did you mean `base_url`? ({file}, line 9)" in said
    assert "Extra inputs are not permitted" not in said and "Traceback" not in said


def test_a_key_with_no_close_match_is_named_without_a_guess(tmp_path: Path) -> None:
    file = write_config(tmp_path, "\n\nzzzz_qqq = 1\n")

    done = ember(ember_env(tmp_path, None), "sessions", "list")

    assert done.returncode == 2
    assert f"zzzz_qqq: not a setting Ember knows ({file}, line 3)" in one_line(done.stderr)


def test_an_environment_variable_is_named_as_the_source(tmp_path: Path) -> None:
    write_config(tmp_path, "model_timeout_s = 30\n")
    env = ember_env(tmp_path, None, EMBER_MODEL_TIMEOUT_S="-5", EMBER_TELEGRAM__TOKN="x")

    done = ember(env, "sessions", "list")

    said = one_line(done.stderr)
    assert done.returncode == 2
    assert "model_timeout_s: Input should be greater than 0 (environment variable EMBER_MODEL_TIMEOUT_S)" in said
    assert ("telegram.tokn: not a setting Ember knows; did you mean `token`? "
            "(environment variable EMBER_TELEGRAM__TOKN)") in said


@pytest.mark.parametrize(("key", "value"), [("model_timeout_s", -5), ("model_timeout_s", 0),
                                            ("gateway_port", 70_000), ("max_tool_iterations", 0)])
def test_numbers_out_of_range_are_refused_where_they_are_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: int) -> None:
    file = write_config(tmp_path, f"# a comment\n{key} = {value}\n")
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))

    with pytest.raises(ConfigError) as refused:
        load_settings()

    assert f"{key}: Input should be" in str(refused.value) and f"({file}, line 2)" in str(refused.value)


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValidationError, match="0 USD or more"):
        Settings(budget_usd_per_day={"local": -1.0})


def test_toml_lines_follow_tables_dotted_keys_and_arrays_of_tables() -> None:
    lines = toml_lines('a = 1\nb.c = 2\n[t]\n"q" = 3\n[[r.s]]\nz = 1\n[[r.s]]\nz = 2 # two\n')

    assert lines[("a",)] == 1 and lines[("b", "c")] == 2 and lines[("t", "q")] == 4
    assert lines[("r", "s", 0, "z")] == 6 and lines[("r", "s", 1, "z")] == 8


def test_doctor_with_a_bad_config_still_runs_its_other_checks(tmp_path: Path) -> None:
    write_config(tmp_path, 'modle = "x"\nmodel_timeout_s = -5\nagent_name = "Kept"\n')

    done = ember(ember_env(tmp_path, None), "doctor")

    assert done.returncode == 1
    out = done.stdout
    assert out.startswith("FAIL  config: invalid configuration:") and "did you mean `model`" in out
    assert "the checks below ran without model_timeout_s, modle, left at the defaults" in one_line(out)
    # The checks that need no valid configuration all ran: the home, the workspace, the store, the model.
    for check in ("ok    config: home", "workspace", "ok    store", "ok    background jobs", "ok    memory",
                  "no model configured"):
        assert check in out, check
    assert "Traceback" not in out + done.stderr


def test_doctor_with_a_file_that_does_not_parse_runs_on_the_environment(tmp_path: Path) -> None:
    write_config(tmp_path, "this is = not = toml\n")

    done = ember(ember_env(tmp_path, None), "doctor")

    assert done.returncode == 1
    assert "FAIL  config:" in done.stdout and "ember.toml" in done.stdout
    assert "ok    store" in done.stdout
