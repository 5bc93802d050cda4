"""``lmc chat``: talk with an instruct model on a terminal, or answer one conversation.

On a terminal: line editing and history (prompt_toolkit, as the field's
interactive clients use), Alt+Enter or a line of three quotes for multi-line
input, replies streamed token by token, Ctrl-C stops a reply and keeps the
conversation, Ctrl-D or /exit leaves. With ``--messages FILE.json`` it renders
that conversation, generates one reply and prints it (``--json``: ids, text,
stop reason and stats). With input piped in, each line is a user turn.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..chat import ChatSession, ChatSettings, read_messages
from ..api import load
from ..errors import RunError
from ..sampling import SamplerConfig
from ..status import StatusLine
from .common import (CliError, check_context_shift, constraint_args, constraint_flag, constraint_of,
                     context_shift_args, exec_args, finish_compiling, grammar_kept, kv_type_arg, model_args,
                     positive_or_zero, resolve_model, sampling_args, sampling_of, speculation_args, speculation_of)

HELP = """commands:
  /system TEXT   set the system message (an empty TEXT removes it)
  /reset         forget the conversation (the system message stays)
  /save FILE     write the conversation as JSON messages
  /load FILE     read a conversation written by /save (or any JSON message list)
  /stats         tokens and timings of each turn (prefilled = run this turn, cached = kept from the last)
  /tool RESULT   answer the last reply's tool call with its result (with --tools)
  /exit          leave (Ctrl-D does too)
Alt+Enter starts a new line; or type \"\"\" alone on a line, then lines, then \"\"\" again.
Ctrl-C stops the reply being written and keeps what was said."""


def add_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat with an instruct model (its own chat template)")
    model_args(c, optional=True)
    c.add_argument("--system", default=None, metavar="TEXT", help="system message")
    c.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="a jinja template file, or chatml, llama2, llama3, gemma, phi3, plain (default: the "
                        "model's own template, else plain)")
    c.add_argument("--messages", default=None, metavar="FILE.json",
                   help="answer this conversation (a JSON list of {role, content}) once and exit")
    c.add_argument("-n", "--max-new-tokens", type=positive_or_zero("-n"), default=1024,
                   help="longest reply in tokens (default 1024; a reply also ends at the end of the context)")
    sampling_args(c, temp=0.8, top_p=0.95, top_k=40, min_p=0.05)   # llama.cpp's defaults
    c.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="end a reply at STR (not shown); repeatable")
    c.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    context_shift_args(c, "the system prompt's tokens, as the template renders them")
    c.add_argument("--shift-by", choices=("recompute", "rotate"), default="recompute",
                   help="with --context-shift: recompute the kept tokens' KV rows (exact, the default), or move "
                        "them and turn their keys (llama.cpp's way: cheaper, not exact; f32/f16 caches, else it "
                        "recomputes)")
    kv_type_arg(c)
    exec_args(c)
    c.add_argument("--json", action="store_true", help="with --messages: print one JSON object")
    speculation_args(c)
    constraint_args(c)
    c.add_argument("--tools", default=None, metavar="FILE.json",
                   help="functions the model may call (OpenAI's tools list); a call is shown as [tool call] "
                        "name {arguments}, and /tool RESULT answers it")


def run(args: argparse.Namespace) -> int:
    status = StatusLine()
    try:
        session = _session(args, status)
    finally:
        status.clear()
    if args.json and args.messages is None:
        raise CliError("--json goes with --messages (one answer as one object)")
    code = (_answer_once(session, args) if args.messages is not None
            else _interactive(session, args) if sys.stdin.isatty() and sys.stdout.isatty()
            else _piped(session, constraint_flag(args)))
    finish_compiling(session.model, StatusLine())
    return code


def _session(args: argparse.Namespace, status: StatusLine) -> ChatSession:
    from frontends.chat_template import resolve_chat_template

    check_context_shift(args)
    if args.shift_by != "recompute" and not args.context_shift:
        raise CliError("--shift-by goes with --context-shift")
    model_path, tok_path = resolve_model(args)
    messages = read_messages(args.messages) if args.messages is not None else None
    model = load(model_path, tok_path, backend=args.backend, ctx=args.ctx, threads=args.threads,
                 use_cache=not args.no_cache, kv_type=args.kv_type, status=status, speculation=speculation_of(args),
                 context_shift=args.context_shift and args.shift_by, keep=args.keep,
                 decode_first=True)
    tok = model.tokenizer
    if args.chat_template is not None:
        tok.chat_template = resolve_chat_template(args.chat_template, tok.model_chat_template,
                                                  os.path.basename(model_path))
    else:
        tok.chat_template  # resolve now: a broken template is an error before the first turn
    settings = ChatSettings(max_new_tokens=args.max_new_tokens, stop=args.stop or [], sampling=sampling_of(args))
    SamplerConfig(**settings.sampling).validate()   # a bad flag is an error now, not at the first turn
    settings.grammar = constraint_of(args)          # every reply follows it
    settings.tools = _read_tools(args.tools) if args.tools is not None else None
    session = ChatSession(model, args.system, settings)
    if messages is not None:
        session.set_messages(messages)
        if args.system is not None:
            session.system = args.system
    return session


def _answer_once(session: ChatSession, args: argparse.Namespace) -> int:
    stream = session.reply()
    flag = constraint_flag(args)

    def generated() -> int:
        return len(stream.completion.generated_ids)
    if args.json:
        with grammar_kept(flag, generated):
            text = "".join(stream)
        comp = stream.completion
        turn = session.turns[-1]
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                 for c in session.last_tool_calls]
        print(json.dumps({"prompt_ids": comp.prompt_ids, "generated_ids": comp.generated_ids, "text": text,
                          "stop_reason": comp.stop_reason, "tool_calls": calls or None,
                          "stats": {**comp.stats.as_dict(), "first_token_s": round(turn.first_token_s, 6),
                                    "dropped_messages": turn.dropped_messages,
                                    "chat_template": session.model.tokenizer.chat_template.name}},
                         ensure_ascii=False))
        return 0
    with grammar_kept(flag, generated, lambda: sys.stdout.write("\n")):
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    _show_calls(session)
    return 0


def _read_tools(path: str) -> list:
    from ..tool_calls import ToolCallError, check_tools

    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
        if isinstance(tools, dict) and "tools" in tools:
            tools = tools["tools"]
        return check_tools(tools)
    except OSError as e:
        raise CliError(f"--tools {path}: {e.strerror}") from None
    except (json.JSONDecodeError, ToolCallError) as e:
        raise CliError(f"--tools {path}: {e}") from None


def _show_calls(session: ChatSession) -> None:
    """The last reply's tool calls, plainly."""
    for c in session.last_tool_calls:
        fn = c["function"]
        print(f"[tool call] {fn['name']} {json.dumps(fn['arguments'], ensure_ascii=False)}")


def _piped(session: ChatSession, flag: str | None) -> int:
    """Each input line is a user turn; each reply is printed, then a blank
    line. A grammar (``flag``'s) that cannot go on ends the run (one line)."""
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stream = session.send(line)
        with grammar_kept(flag, lambda: len(stream.completion.generated_ids), lambda: sys.stdout.write("\n")):
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        sys.stdout.write("\n\n")
        sys.stdout.flush()
    return 0


def _interactive(session: ChatSession, args: argparse.Namespace) -> int:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    from frontends.cache_dir import cache_root

    keys = KeyBindings()

    @keys.add("escape", "enter")   # Alt+Enter (Esc, Enter): a new line in the message
    def _(event) -> None:
        event.current_buffer.insert_text("\n")

    os.makedirs(cache_root(), exist_ok=True)
    prompt = PromptSession(history=FileHistory(os.path.join(cache_root(), "chat_history")), key_bindings=keys)
    m = session.model
    print(f"{os.path.basename(m.loaded.path)}: chat template {m.tokenizer.chat_template.name}, context {m.ctx} "
          f"tokens. /help for commands, Ctrl-D to leave.")
    while True:
        try:
            line = prompt.prompt(">>> ", multiline=False)
        except KeyboardInterrupt:
            continue        # Ctrl-C at the prompt clears the line
        except EOFError:
            return 0
        if line.strip() == '"""':
            line = _multiline(prompt)
            if line is None:
                continue
        if line.startswith("/"):
            if _command(session, line) == "exit":
                return 0
            continue
        if not line.strip():
            continue
        try:
            stream = session.send(line)
        except (RunError, ValueError) as e:
            print(f"[{e}]")
            continue
        turn = session.turns[-1]
        if turn.dropped_messages:
            print(f"[the conversation outgrew the context of {m.ctx} tokens: the oldest {turn.dropped_messages} "
                  f"messages were dropped]")
        try:
            with grammar_kept(constraint_flag(args), lambda: len(stream.completion.generated_ids)):
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            stream.close()
            sys.stdout.write(" [stopped]")
        except CliError as e:   # the grammar cannot go on: the reply stays as far as it got
            sys.stdout.write(f" [{e}]")
        sys.stdout.write("\n")
        if turn.context_shifts:
            keep = stream.completion.stats.extra.get("keep")
            print(f"[context full ({m.ctx} tokens): {turn.context_shifts} shift{'s' if turn.context_shifts != 1 else ''} this "
                  f"turn dropped {turn.shifted_tokens} tokens after the first {keep}]")
        sys.stdout.flush()
        _show_calls(session)


def _multiline(prompt) -> str | None:
    lines = []
    while True:
        try:
            line = prompt.prompt("... ", multiline=False)
        except (KeyboardInterrupt, EOFError):
            return None
        if line.strip() == '"""':
            return "\n".join(lines)
        lines.append(line)


def _command(session: ChatSession, line: str) -> str | None:
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    try:
        if name in ("/exit", "/quit", "/bye"):
            return "exit"
        if name == "/help":
            print(HELP)
        elif name == "/reset":
            session.reset()
            print("[conversation cleared]")
        elif name == "/system":
            session.system = rest
            print(f"[system message {'set' if rest else 'removed'}]")
        elif name == "/save":
            if not rest:
                raise RunError("/save FILE")
            session.save(rest)
            print(f"[{len(session.messages)} messages written to {rest}]")
        elif name == "/load":
            if not rest:
                raise RunError("/load FILE")
            session.load(rest)
            print(f"[{len(session.messages)} messages read from {rest}]")
        elif name == "/stats":
            _print_stats(session)
        elif name == "/tool":
            if not rest:
                raise RunError("/tool RESULT (the result of the last tool call)")
            for piece in session.send_tool_result(rest):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            _show_calls(session)
        else:
            print(f"[unknown command {name}; /help lists them]")
    except (RunError, OSError, ValueError) as e:
        print(f"[{e}]")
    return None


def _print_stats(session: ChatSession) -> None:
    if not session.turns:
        print("[no turns yet]")
    for i, t in enumerate(session.turns, 1):
        tok_s = f"{t.decode_tok_s} tok/s" if t.decode_tok_s else "-"
        print(f"turn {i}: prompt {t.prompt_tokens} tokens ({t.cached_tokens} cached, {t.prefilled_tokens} "
              f"prefilled), {t.generated_tokens} generated, first token {t.first_token_s:.3f} s, {tok_s}, "
              f"stop: {t.stop_reason}" + (f", context shifts {t.context_shifts} ({t.shifted_tokens} tokens dropped)"
                                          if t.context_shifts else ""))
