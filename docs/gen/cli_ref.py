"""CLI reference: every visible command of a click/typer command tree as Markdown.

It reads the command objects typer builds (`typer.main.get_command(app)`): names, help texts,
usage lines and parameters. Nothing is invoked, so no server starts and no verb runs. Only the
attributes click and typer share are used (typer vendors its own click, so `isinstance` checks
against the `click` package would miss its classes); typer's `<type>` labels are used when
present.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from mdtext import code, prose, slug, table


@dataclass(frozen=True)
class CommandDoc:
    path: str  # e.g. "hpcml plan memory"
    depth: int  # 0 for the root command
    command: Any
    context: Any


def walk(command: Any, prog_name: str) -> list[CommandDoc]:
    """The root and every visible sub-command, depth first, in the CLI's own order."""
    root_ctx = command.context_class(command, info_name=prog_name)
    found: list[CommandDoc] = []

    def visit(cmd: Any, ctx: Any, depth: int) -> None:
        found.append(CommandDoc(ctx.command_path, depth, cmd, ctx))
        if not hasattr(cmd, "list_commands"):
            return
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            visit(sub, sub.context_class(sub, info_name=name, parent=ctx), depth + 1)

    visit(command, root_ctx, 0)
    return found


def help_paragraphs(text: str | None) -> list[str]:
    """Help text -> Markdown paragraphs (click's `\\f` cut and `\\b` markers honoured)."""
    text = inspect.cleandoc(text or "").partition("\f")[0]
    return [prose(p.replace("\b", "")) for p in text.split("\n\n") if p.strip()]


def first_sentence(text: str | None) -> str:
    paragraphs = help_paragraphs(text)
    return paragraphs[0] if paragraphs else ""


def usage(doc: CommandDoc) -> str:
    pieces = doc.command.collect_usage_pieces(doc.context)
    return " ".join([doc.path, *pieces])


def param_names(param: Any) -> str:
    names = list(param.opts)
    if param.param_type_name == "argument":
        # typer shows an argument by its name (or metavar); click by its upper-case name.
        names = [getattr(param, "display_name_raw", None) or param.human_readable_name]
    names += list(param.secondary_opts)
    return " / ".join(code(n) for n in names)


def param_type(param: Any, ctx: Any) -> str:
    """typer's `<int>`-style label without the brackets, else click's type name."""
    if getattr(param, "is_flag", False) and not param.secondary_opts:
        label = "flag"
    elif hasattr(param, "display_type"):
        label = param.display_type(ctx).strip("<>")
    else:
        label = getattr(getattr(param, "type", None), "name", "") or "text"
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    bounds = [f"≥ {low}" if low is not None else "", f"≤ {high}" if high is not None else ""]
    bounds = [b for b in bounds if b]
    if bounds and label.endswith(" range"):
        label = label[: -len(" range")]
    many = param.nargs == -1 or param.multiple
    if many and label.startswith("list[") and label.endswith("]"):
        label = label[len("list[") : -1]
    if label == "Path":  # typer names a list element by its class, a single one "path"
        label = "path"
    parts = [code(label), *bounds]
    if many:
        parts.append("repeatable" if param.multiple else "any number")
    return ", ".join(parts)


def param_default(param: Any) -> str:
    if param.required:
        return "required"
    if param.show_default is False:
        return ""
    if isinstance(param.show_default, str):
        return prose(param.show_default)
    value = param.default
    if callable(value):
        return "computed"
    if value is None or value == [] or value == ():
        return ""
    if isinstance(value, bool):
        return code("true" if value else "false")
    if isinstance(value, PurePath):
        value = str(value)
    if isinstance(value, list | tuple):
        return ", ".join(code(v) for v in value)
    return code(value)


def param_table(params: list[Any], ctx: Any) -> str:
    rows = [
        [
            param_names(p),
            param_type(p, ctx),
            param_default(p),
            prose(getattr(p, "help", None) or ""),
        ]
        for p in params
    ]
    return table(["Name", "Type", "Default", "Description"], rows)


def anchor(path: str) -> str:
    return slug(path)


def render_command(doc: CommandDoc) -> str:
    level = "#" * min(2 + doc.depth, 6)
    cmd, ctx = doc.command, doc.context
    out = [f"{level} {doc.path} {{#{anchor(doc.path)}}}", ""]
    if cmd.deprecated:
        out += ["!!! warning", "    Deprecated.", ""]
    for paragraph in help_paragraphs(cmd.help or cmd.short_help):
        out += [paragraph, ""]
    out += ["```text", usage(doc), "```", ""]
    visible = [p for p in cmd.params if not getattr(p, "hidden", False)]
    arguments = [p for p in visible if p.param_type_name == "argument"]
    options = [p for p in visible if p.param_type_name != "argument"]
    if arguments:
        out += ["**Arguments**", "", param_table(arguments, ctx), ""]
    if options:
        out += ["**Options**", "", param_table(options, ctx), ""]
    if hasattr(cmd, "list_commands"):
        rows = []
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            path = f"{doc.path} {name}"
            link = f"[{code(path)}](#{anchor(path)})"
            rows.append([link, first_sentence(sub.short_help or sub.help)])
        if rows:
            out += ["**Commands**", "", table(["Command", "Description"], rows), ""]
    return "\n".join(out)


def render_cli_reference(command: Any, prog_name: str) -> str:
    """The whole generated part of the CLI reference page for the command tree `command`
    (a click or typer command, e.g. `typer.main.get_command(app)`)."""
    docs = walk(command, prog_name)
    return "\n".join(render_command(d) for d in docs).rstrip() + "\n"
