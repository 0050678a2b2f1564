"""The CLI's finite, non-negative number guard (hpcml.cli.app) on every typer the project
admits. typer 0.29 describes a parameter by its annotation (`bare_type`); older typer and click
by a ParamType. On the GPU image's typer the guard asked for `bare_type` and every `hpcml` verb
crashed with an AttributeError before doing anything (make gpu, run 1)."""

from __future__ import annotations

import click
import typer

from hpcml.cli.app import _finite_non_negative, _guard_numbers, _is_number, app


def test_click_parameters_are_told_apart_by_their_type() -> None:
    # click's own parameters have no bare_type and no type_descriptor: the older typers' case.
    assert _is_number(click.Option(["--rate"], type=float))
    assert _is_number(click.Option(["--n"], type=int))
    assert _is_number(click.Option(["--n"], type=click.IntRange(0, 5)))
    assert not _is_number(click.Option(["--name"], type=str))
    assert not _is_number(click.Argument(["path"], type=click.Path()))
    assert not _is_number(click.Option(["--json"], is_flag=True))


def test_a_click_command_gets_the_guard_on_its_numbers_only() -> None:
    cmd = click.Command(
        "loadtest",
        params=[click.Option(["--rate"], type=float), click.Option(["--model"], type=str)],
    )
    _guard_numbers(click.Group("hpcml", commands={"loadtest": cmd}))
    rate, model = cmd.params
    assert rate.callback is _finite_non_negative and model.callback is None


def test_every_float_option_of_this_typer_is_guarded() -> None:
    cmd = typer.main.get_command(app)
    _guard_numbers(cmd)
    loadtest = cmd.commands["loadtest"]  # type: ignore[attr-defined]
    rate = next(p for p in loadtest.params if p.name == "rate")
    assert rate.callback is _finite_non_negative
