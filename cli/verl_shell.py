"""Read a verl launch script as bash would expand it, without running any of it.

``rlx train --from-verl "$(cat run_qwen2-7b.sh)"`` hands rlx a whole shell script: variable assignments,
``export``, ``${VAR:-default}``, ``$((a * b))``, bash arrays, ``if [ ... ]`` blocks, line continuations,
comments and several commands, one of which starts verl's trainer. :func:`trainer_words` walks the script
in order, keeps the variables it assigns, expands the words of the first command that runs
``verl.trainer.main_ppo`` (or another ``main_ppo`` module) and returns them.

Nothing is executed. Command substitutions (``$(...)``, backticks) are not run: the few pure ones verl's
scripts use to build names (``basename``, ``dirname``, ``pwd``, ``date``) are computed here; any other is
kept as a marker that the caller reports, with the key it feeds, if that key matters. A variable that is set
neither in the script nor in the environment is reported the same way.
"""

from __future__ import annotations

import datetime
import fnmatch
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlx.errors import UserError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?=)(.*)", re.S)
_OPERATORS = ("&&", "||", ";;", ";", "&", "|", "\n")
_DECLARERS = {"export", "local", "declare", "typeset", "readonly"}
_IGNORED_BUILTINS = {"set", "cd", "echo", "printf", "source", ".", "ulimit", "ray", "pip", "mkdir", "wait",
                     "sleep", "trap", "shift", "true", "false", "unset", "nvidia-smi", "which", "tee", "ls",
                     "rm", "cp", "mv", "sed", "cat", "python", "python3", "hf", "huggingface-cli", "wget",
                     "git", "conda", "pushd", "popd", "alias", "eval", "umask", "hostname", "command"}


@dataclass
class Word:
    """One field of a command after expansion. ``unset``: variables it used that nothing set;
    ``commands``: command substitutions it would run (never run here)."""

    text: str
    unset: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)


@dataclass
class ShellRead:
    """The trainer command's words after the module (``key=value`` overrides and flags), and notes."""

    words: list[Word]
    notes: list[str] = field(default_factory=list)


class _Unknown(Exception):
    """A construct this reader does not follow (the caller decides what that means)."""


# -- splitting the script into commands ----------------------------------------------------------------
def _tokens(text: str) -> list[str]:
    """Words (raw, quotes kept) and operators, bash's way: quotes, ``$(...)``, ``${...}``, backticks and
    ``$((...))`` never split a word; ``#`` at a word's start comments out the rest of the line; a backslash
    before a newline joins the lines."""
    out: list[str] = []
    i, n, word = 0, len(text), ""
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                i += 2
                continue
            word += text[i:i + 2]
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise UserError("--from-verl: a single quote (') is never closed in the script.",
                                "Check the script's quotes.")
            word += text[i:j + 1]
            i = j + 1
        elif c == '"':
            j = _closing_double_quote(text, i)
            word += text[i:j + 1]
            i = j + 1
        elif c == "`":
            j = text.find("`", i + 1)
            if j < 0:
                raise UserError("--from-verl: a backtick (`) is never closed in the script.",
                                "Check the script's quotes.")
            word += text[i:j + 1]
            i = j + 1
        elif c == "$" and i + 1 < n and text[i + 1] in "({":
            j = _closing_bracket(text, i + 1)
            word += text[i:j + 1]
            i = j + 1
        elif c == "#" and not word:
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in " \t\r":
            if word:
                out.append(word)
                word = ""
            i += 1
        elif c == "(" and word.endswith("="):  # NAME=( array words )
            j = _closing_bracket(text, i)
            word += text[i:j + 1]
            i = j + 1
        elif c == "(" and text.startswith("()", i) and word:  # name() { ...: a function definition
            out.append(word + "()")
            word = ""
            i += 2
        elif c in ";&|\n()<>":
            if word:
                out.append(word)
                word = ""
            op = text[i:i + 2] if text[i:i + 2] in ("&&", "||", ";;", ">>", "&>") else c
            opened = max((k for k, t in enumerate(out) if t == "[["), default=-1)
            if op in ("&&", "||") and opened > max((k for k, t in enumerate(out) if t == "]]"), default=-1):
                out.append("-a" if op == "&&" else "-o")  # inside [[ ... ]]: a condition, not a list
            else:
                out.append(op)
            i += len(op)
        else:
            word += c
            i += 1
    if word:
        out.append(word)
    return out


def _closing_double_quote(text: str, start: int) -> int:
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i
        if c == "$" and i + 1 < len(text) and text[i + 1] in "({":
            i = _closing_bracket(text, i + 1) + 1
            continue
        if c == "`":
            j = text.find("`", i + 1)
            i = (j if j >= 0 else len(text)) + 1
            continue
        i += 1
    raise UserError('--from-verl: a double quote (") is never closed in the script.', "Check the script's quotes.")


def _closing_bracket(text: str, start: int) -> int:
    """The index of the bracket closing the one at ``start`` (``(`` or ``{``), skipping quoted text."""
    pairs = {"(": ")", "{": "}"}
    stack = [pairs[text[start]]]
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "'" and stack[-1] == ")":
            j = text.find("'", i + 1)
            i = (j if j >= 0 else len(text)) + 1
            continue
        if c == '"':
            i = _closing_double_quote(text, i) + 1
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif c == stack[-1]:
            stack.pop()
            if not stack:
                return i
        i += 1
    raise UserError(f"--from-verl: '{text[start - 1:start + 1]}' is never closed in the script.",
                    "Check the script's brackets.")


def _commands(tokens: list[str]) -> list[tuple[list[str], str]]:
    """(words, the operator after them); redirections (``> file``, ``2>&1``) are left out."""
    out: list[tuple[list[str], str]] = []
    words: list[str] = []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
            continue
        if tok in (">", ">>", "<", "2>", "&>"):
            skip = True
            continue
        if tok in ("(", ")"):
            continue
        if tok in _OPERATORS:
            out.append((words, tok))
            words = []
            continue
        words.append(tok)
    if words:
        out.append((words, "\n"))
    return out


# -- expanding one word ----------------------------------------------------------------------------------
class _Expander:
    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.notes: list[str] = []
        self.unset_empty = False  # in a condition or an assignment an unset variable is empty, as in bash
        self.taint: dict[str, list[str]] = {}  # variable -> the unset variables its value was built from
        self.vars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}

    def lookup(self, name: str) -> str | None:
        if name in self.arrays:
            return self.arrays[name][0] if self.arrays[name] else ""
        if name in self.vars:
            return self.vars[name]
        if name in ("#", "?"):
            return "0"
        if name in ("HOME", "USER", "PWD"):
            return self.environ.get(name, {"HOME": os.path.expanduser("~"), "USER": "user", "PWD": os.getcwd()}[name])
        return self.environ.get(name)

    def fields(self, raw: str) -> list[Word]:
        """The fields ``raw`` expands to: unquoted expansions split on whitespace, ``"${A[@]}"`` one field
        per element, ``$@`` nothing."""
        pieces: list[tuple[str, bool]] = []  # (text, may split)
        info = Word("")
        self._expand(raw, pieces, info, quoted=False)
        out: list[str] = []
        current: str | None = None
        for text, splittable in pieces:
            if text == "\0FIELD":  # a boundary between array elements
                out.append(current or "")
                current = None
                continue
            if not splittable:
                current = (current or "") + text
                continue
            parts = re.split(r"[ \t\n]+", text)
            for k, part in enumerate(parts):
                if k > 0:
                    if current is not None:
                        out.append(current)
                    current = None
                if part:
                    current = (current or "") + part
        if current is not None:
            out.append(current)
        return [Word(text, list(info.unset), list(info.commands)) for text in out]

    def text(self, raw: str) -> Word:
        """``raw`` expanded as one string (an assignment's value: quotes removed, no field splitting)."""
        pieces: list[tuple[str, bool]] = []
        info = Word("")
        self._expand(raw, pieces, info, quoted=False)
        info.text = "".join(" " if t == "\0FIELD" else t for t, _ in pieces)
        return info

    def _expand(self, raw: str, out: list[tuple[str, bool]], info: Word, quoted: bool) -> None:
        i, n = 0, len(raw)
        while i < n:
            c = raw[i]
            if c == "\\" and i + 1 < n:
                nxt = raw[i + 1]
                if not quoted or nxt in '$`"\\\n':
                    out.append((nxt, False))
                    i += 2
                    continue
                out.append((c, False))
                i += 1
            elif c == "'" and not quoted:
                j = raw.index("'", i + 1)
                out.append((raw[i + 1:j], False))
                if j == i + 1:
                    out.append(("", False))
                i = j + 1
            elif c == '"' and not quoted:
                j = _closing_double_quote(raw, i)
                inner: list[tuple[str, bool]] = [("", False)]
                self._expand(raw[i + 1:j], inner, info, quoted=True)
                out.extend(inner)
                i = j + 1
            elif c == "`":
                j = raw.index("`", i + 1)
                out.append(self._substituted(raw[i + 1:j], info, quoted))
                i = j + 1
            elif c == "$" and raw.startswith("$((", i) and _arith_end(raw, i) > 0:
                j = _arith_end(raw, i)
                out.append((self._arith(raw[i + 3:j - 1], info), not quoted))
                i = j + 1
            elif c == "$" and raw.startswith("$(", i):
                j = _closing_bracket(raw, i + 1)
                out.append(self._substituted(raw[i + 2:j], info, quoted))
                i = j + 1
            elif c == "$" and raw.startswith("${", i):
                j = _closing_bracket(raw, i + 1)
                try:
                    self._parameter(raw[i + 2:j], out, info, quoted)
                except _Unknown:  # Hydra's ${a.b} interpolation, or a form not followed: kept as written
                    out.append((raw[i:j + 1], False))
                    if "." not in raw[i + 2:j]:  # a dotted name is Hydra's, resolved later
                        self.notes.append(f"{raw[i:j + 1]} is kept as written (a form rlx's reader does not "
                                          "expand)")
                i = j + 1
            elif c == "$" and i + 1 < n and raw[i + 1] in "@*":
                i += 2  # the script's own arguments: none here
            elif c == "$" and i + 1 < n and (raw[i + 1].isdigit() or raw[i + 1] in "#?$!"):
                out.append(("0" if raw[i + 1] in "#?" else "", not quoted))
                i += 2
            elif c == "$" and _NAME.match(raw, i + 1):
                m = _NAME.match(raw, i + 1)
                assert m is not None
                out.append((self._value(m.group(0), info), not quoted))
                i = m.end()
            else:
                out.append((c, False))
                i += 1

    def _value(self, name: str, info: Word) -> str:
        value = self.lookup(name)
        if value is None:
            info.unset.append(name)
            return "" if self.unset_empty else f"${name}"
        info.unset += self.taint.get(name, [])
        return value

    def _parameter(self, body: str, out: list[tuple[str, bool]], info: Word, quoted: bool) -> None:
        """``${...}``: plain, ``:-``/``-``/``:=``/``=``/``:+``/``+`` defaults, ``#`` length, ``#``/``##``/
        ``%``/``%%`` trimming, ``/`` replacement, array elements and ``[@]``."""
        m = _NAME.match(body)
        if body.startswith("#") and _NAME.fullmatch(body[1:]):
            out.append((str(len(self.lookup(body[1:]) or "")), not quoted))
            return
        if body[:1] in ("@", "*"):
            return
        positional = re.match(r"\d+", body)
        if positional:  # ${1:-default}: the script's arguments, of which there are none here
            rest = body[positional.end():]
            for op in (":-", ":=", ":+", "-", "=", "+"):
                if rest.startswith(op) and op[-1] in "-=":
                    word = self.text(rest[len(op):])
                    info.unset += word.unset
                    info.commands += word.commands
                    out.append((word.text, not quoted))
                    return
                if rest.startswith(op):
                    return  # ${1:+alt}: empty, the argument is not given
            if rest:
                raise _Unknown(f"${{{body}}}")
            return
        if m is None:
            raise _Unknown(f"${{{body}}}")
        name, rest = m.group(0), body[m.end():]
        if rest.startswith("["):
            close = rest.index("]")
            index, rest = rest[1:close], rest[close + 1:]
            items = self.arrays.get(name, [] if name not in self.vars else [self.vars[name]])
            if index in ("@", "*"):
                if not rest:
                    for k, item in enumerate(items):
                        if k:
                            out.append(("\0FIELD", False) if quoted else (" ", True))
                        out.append((item, not quoted))
                    return
                raise _Unknown(f"${{{body}}}")
            try:
                position = int(self._arith(index, info))  # ValueError when it lacks a variable
                out.append((items[position] if -len(items) <= position < len(items) else "", not quoted))
            except (IndexError, ValueError):
                out.append(("", not quoted))
            return
        value = self.lookup(name)
        for op in (":-", ":=", ":+", "-", "=", "+"):
            if rest.startswith(op):
                word = self.text(rest[len(op):])
                info.unset += word.unset
                info.commands += word.commands
                empty = value is None or (op.startswith(":") and value == "")
                if op in (":-", "-"):
                    result = word.text if empty else value
                elif op in (":=", "="):
                    if empty:
                        self.vars[name] = word.text
                    result = word.text if empty else value
                else:
                    result = "" if empty else word.text
                if not empty:
                    info.unset += self.taint.get(name, [])
                out.append((result or "", not quoted))
                return
        if value is None:
            info.unset.append(name)
            value = "" if self.unset_empty else f"${{{name}}}"
        else:
            info.unset += self.taint.get(name, [])
        for op in ("##", "#", "%%", "%"):
            if rest.startswith(op):
                out.append((_trim(value, self.text(rest[len(op):]).text, op), not quoted))
                return
        sub = re.fullmatch(r":\s*(-?\d+)(?::(\d+))?", rest)
        if sub:  # ${A:offset} and ${A:offset:length}
            start = int(sub.group(1))
            start = max(len(value) + start, 0) if start < 0 else start
            end = start + int(sub.group(2)) if sub.group(2) is not None else None
            out.append((value[start:end], not quoted))
            return
        if rest.startswith("/"):
            every = rest.startswith("//")
            pattern, _, replacement = rest[2 if every else 1:].partition("/")
            regex = fnmatch.translate(self.text(pattern).text).removesuffix(r"\Z").removeprefix("(?s:")
            regex = regex[:-1] if regex.endswith(")") else regex
            out.append((re.sub(regex, self.text(replacement).text.replace("\\", r"\\"), value,
                               count=0 if every else 1), not quoted))
            return
        if rest:
            raise _Unknown(f"${{{body}}}")
        out.append((value, not quoted))

    def _substituted(self, command: str, info: Word, quoted: bool) -> tuple[str, bool]:
        """A command substitution's piece: its computed text (split when unquoted), or the marker of one
        that is not run, kept whole."""
        before = len(info.commands)
        text = self._substitute(command, info)
        return text, not quoted and len(info.commands) == before

    def _substitute(self, command: str, info: Word) -> str:
        """A command substitution: the pure name-building ones are computed, the rest never run."""
        words = [w.text for raw in _tokens(command.strip()) if raw not in _OPERATORS for w in self.fields(raw)]
        head = words[0] if words else ""
        if head == "basename" and len(words) >= 2:
            base = posixpath.basename(words[1].rstrip("/"))
            return base[:-len(words[2])] if len(words) > 2 and base.endswith(words[2]) else base
        if head == "dirname" and len(words) == 2:
            return posixpath.dirname(words[1].rstrip("/")) or "."
        if head == "pwd" and len(words) == 1:
            return os.getcwd()
        if head == "date" and len(words) <= 2:
            fmt = words[1][1:] if len(words) == 2 and words[1].startswith("+") else "%a %b %d %H:%M:%S %Z %Y"
            return datetime.datetime.now().strftime(fmt)
        info.commands.append(command.strip())
        return f"$({command.strip()})"

    def _arith(self, expr: str, info: Word) -> str:
        word = self.text(expr)  # $VAR and ${VAR:-8} inside are expanded first
        info.unset += word.unset
        info.commands += word.commands
        if word.unset or word.commands:
            return f"$(({expr}))"  # reported by the caller with the variable it lacks
        try:
            return str(_Arith(word.text, self).value())
        except (ValueError, ZeroDivisionError, IndexError) as exc:
            raise UserError(f"--from-verl: the arithmetic $(({expr})) cannot be computed ({exc}).",
                            "rlx computes integer arithmetic of numbers and variables the script sets.") from None


def _arith_end(raw: str, start: int) -> int:
    """The index of the second ``)`` closing ``$((`` at ``start``, or -1 when it is ``$( (...) )``."""
    j = _closing_bracket(raw, start + 1)
    return j if raw[j - 1] == ")" else -1


def _trim(value: str, pattern: str, op: str) -> str:
    def matches(s: str) -> bool:
        return fnmatch.fnmatchcase(s, pattern)
    cuts = range(len(value) + 1)
    if op.startswith("#"):
        order = cuts if op == "#" else reversed(cuts)
        return next((value[k:] for k in order if matches(value[:k])), value)
    order = reversed(cuts) if op == "%" else cuts
    return next((value[:k] for k in order if matches(value[k:])), value)


class _Arith:
    """Integer arithmetic as bash's ``$((...))``: + - * / % **, unary - and +, parentheses, comparisons, and
    names of variables (an unset one is 0, as in bash)."""

    _TOKEN = re.compile(r"\s*(\d+|[A-Za-z_][A-Za-z0-9_]*|\*\*|<=|>=|==|!=|&&|\|\||[-+*/%()<>!])")

    def __init__(self, text: str, shell: _Expander) -> None:
        self.tokens: list[str] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = self._TOKEN.match(text, pos)
            if m is None:
                raise ValueError(f"unexpected {text[pos:].strip()[:10]!r}")
            self.tokens.append(m.group(1))
            pos = m.end()
        self.shell, self.pos = shell, 0

    def value(self) -> int:
        result = self._binary(0)
        if self.pos != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.pos]!r}")
        return result

    _LEVELS = (("||",), ("&&",), ("==", "!="), ("<", "<=", ">", ">="), ("+", "-"), ("*", "/", "%"))

    def _binary(self, level: int) -> int:
        if level == len(self._LEVELS):
            return self._power()
        left = self._binary(level + 1)
        while self.pos < len(self.tokens) and self.tokens[self.pos] in self._LEVELS[level]:
            op = self.tokens[self.pos]
            self.pos += 1
            right = self._binary(level + 1)
            left = _apply(op, left, right)
        return left

    def _power(self) -> int:
        base = self._unary()
        if self.pos < len(self.tokens) and self.tokens[self.pos] == "**":
            self.pos += 1
            return base ** self._power()
        return base

    def _unary(self) -> int:
        tok = self.tokens[self.pos]
        self.pos += 1
        if tok in ("-", "+", "!"):
            inner = self._unary()
            return -inner if tok == "-" else (int(not inner) if tok == "!" else inner)
        if tok == "(":
            inner = self._binary(0)
            if self.tokens[self.pos] != ")":
                raise ValueError("a '(' is never closed")
            self.pos += 1
            return inner
        if tok.isdigit():
            return int(tok)
        if _NAME.fullmatch(tok):
            value = self.shell.lookup(tok)
            return _Arith(value, self.shell).value() if value and value.strip() else 0
        raise ValueError(f"unexpected {tok!r}")


def _apply(op: str, a: int, b: int) -> int:
    if op in ("/", "%"):
        if b == 0:
            raise ZeroDivisionError("division by zero")
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # bash truncates toward zero
        return q if op == "/" else a - q * b
    return {"+": a + b, "-": a - b, "*": a * b, "<": int(a < b), "<=": int(a <= b), ">": int(a > b),
            ">=": int(a >= b), "==": int(a == b), "!=": int(a != b), "&&": int(bool(a and b)),
            "||": int(bool(a or b))}[op]


# -- walking the script ----------------------------------------------------------------------------------
def _is_trainer(word: str) -> bool:
    module = word.removesuffix(".py").replace("/", ".")
    return module.endswith("main_ppo")


def trainer_words(script: str, environ: Mapping[str, str] | None = None) -> ShellRead | None:
    """The expanded words after the trainer module of the first command that starts verl's trainer
    (``python3 -m verl.trainer.main_ppo ...``), or None when no command does."""
    shell = _Expander(os.environ if environ is None else environ)
    notes = shell.notes
    frames: list[list[bool]] = []  # per open if: [this branch runs, a branch already ran, the if's parent runs]
    skip_depth = 0  # inside a function body, a loop of unknown items, a case: not followed

    def running() -> bool:
        return all(frame[0] for frame in frames) and skip_depth == 0

    cmds = _commands(_tokens(script))
    k = 0
    while k < len(cmds):
        words, _op = cmds[k]
        k += 1
        if not words:
            continue
        head = words[0]
        if skip_depth:
            if head in ("done", "esac", "}"):
                skip_depth -= 1
            elif head in ("for", "while", "until", "case", "select") or head.endswith("()") or head == "function":
                skip_depth += 1
            continue
        if head == "if" or head == "elif":
            cond = words[1:]
            if cond and cond[-1] == "then":
                cond = cond[:-1]
            elif k < len(cmds) and cmds[k][0][:1] == ["then"]:
                rest = cmds[k][0][1:]
                cmds[k] = (rest, cmds[k][1])
            if head == "if":
                parent = running()
                frames.append([False, False, parent])
            frame = frames[-1] if frames else None
            if frame is None:
                continue
            if frame[1] or not frame[2]:
                frame[0] = False
                continue
            truth = _condition(cond, shell, notes)
            frame[0] = truth
            frame[1] = truth
            continue
        if head == "then":
            words = words[1:]
            if not words:
                continue
            head = words[0]
        if head == "else":
            if frames:
                frames[-1][0] = frames[-1][2] and not frames[-1][1]
                frames[-1][1] = True
            words = words[1:]
            if not words:
                continue
            head = words[0]
        if head == "fi":
            if frames:
                frames.pop()
            continue
        if head == "for" and len(words) >= 3 and _NAME.fullmatch(words[1]) and words[2] == "in" and running():
            body, end = _loop_body(cmds, k)
            items = [w.text for raw in words[3:] for w in _fields(shell, raw, notes)]
            cmds[k:end] = [c for item in items for c in [([f"{words[1]}={_quote(item)}"], "\n"), *body]]
            continue
        if head in ("for", "while", "until", "case", "select") or head.endswith("()") or head == "function":
            if head in ("for", "while", "until", "select") and running():
                notes.append(f"a `{head}` loop is not followed")
            skip_depth = 1  # a function's body runs only when called; a loop's items are not followed
            continue
        if head in ("do", "done", "{", "}"):
            continue
        if not running():
            continue
        if head == "exit":
            break
        assignments = 0
        for raw in words:
            m = _ASSIGN.fullmatch(raw)
            if not m:
                break
            assignments += 1
        rest = words[assignments:]
        if rest and rest[0] in _DECLARERS:
            for raw in rest[1:]:
                if raw.startswith("-"):
                    continue
                m = _ASSIGN.fullmatch(raw)
                if m:
                    _assign(shell, m)
            continue
        if not rest:
            for raw in words:
                m = _ASSIGN.fullmatch(raw)
                assert m is not None
                _assign(shell, m)
            continue
        fields = [w for raw in rest for w in _fields(shell, raw, notes)]
        for at, word in enumerate(fields):
            if _is_trainer(word.text) and (at == 0 or fields[at - 1].text == "-m" or word.text.endswith(".py")):
                return ShellRead(fields[at + 1:], notes)
    return None


def _loop_body(cmds: list[tuple[list[str], str]], start: int) -> tuple[list[tuple[list[str], str]], int]:
    """The commands between ``do`` and the matching ``done`` (``do`` itself removed), and the index after."""
    depth, body, k = 1, [], start
    while k < len(cmds):
        words, op = cmds[k]
        k += 1
        head = words[0] if words else ""
        if head in ("for", "while", "until", "select"):
            depth += 1
        elif head == "done":
            depth -= 1
            if depth == 0:
                return body, k
        if depth == 1 and head == "do":
            words = words[1:]
        body.append((words, op))
    raise UserError("--from-verl: a `for` loop has no `done`.", "Check the script.")


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _fields(shell: _Expander, raw: str, notes: list[str]) -> list[Word]:
    try:
        return shell.fields(raw)
    except _Unknown as exc:
        notes.append(f"{exc.args[0]} is not expanded (a form rlx's reader does not follow)")
        return [Word(raw)]


def _assign(shell: _Expander, m: re.Match[str]) -> None:
    name, index, op, raw = m.group(1), m.group(2), m.group(3), m.group(4)
    if raw.startswith("(") and raw.endswith(")") and not index:
        items = [w.text for tok in _tokens(raw[1:-1]) if tok not in _OPERATORS for w in shell.fields(tok)]
        shell.arrays[name] = (shell.arrays.get(name, []) if op == "+=" else []) + items
        shell.vars.pop(name, None)
        return
    shell.unset_empty = True
    try:
        word = shell.text(raw)
    finally:
        shell.unset_empty = False
    value = word.text
    if word.unset:  # empty in bash; a setting that uses it later is named with the variable it lacks
        shell.taint[name] = list(dict.fromkeys(shell.taint.get(name, []) * (op == "+=") + word.unset))
    elif op != "+=":
        shell.taint.pop(name, None)
    if index:
        items = shell.arrays.setdefault(name, [])
        try:
            position = int(index[1:-1])
        except ValueError:
            return
        items.extend([""] * (position + 1 - len(items)))
        items[position] = value
        return
    if name in shell.arrays and op != "+=":
        shell.arrays[name] = [value]
        return
    shell.vars[name] = (shell.vars.get(name, "") + value) if op == "+=" else value


def _condition(words: list[str], shell: _Expander, notes: list[str]) -> bool:
    """``[ ... ]``, ``[[ ... ]]`` and ``test ...`` of strings and integers; anything else counts as false
    (and is noted)."""
    if words and words[0] in ("[", "[[", "test"):
        inner = words[1:-1] if words[0] != "test" else words[1:]
    else:
        notes.append(f"the condition `{' '.join(words)}` is not evaluated (taken as false)")
        return False
    shell.unset_empty = True
    try:
        values = [" ".join(w.text for w in shell.fields(raw)) if raw not in ("-a", "-o") else raw for raw in inner]
    finally:
        shell.unset_empty = False
    try:
        return _test(values)
    except (ValueError, IndexError):
        notes.append(f"the condition `{' '.join(words)}` is not evaluated (taken as false)")
        return False


def _test(v: list[str]) -> bool:
    if "-o" in v:
        k = v.index("-o")
        return _test(v[:k]) or _test(v[k + 1:])
    if "-a" in v:
        k = v.index("-a")
        return _test(v[:k]) and _test(v[k + 1:])
    if v and v[0] == "!":
        return not _test(v[1:])
    if len(v) == 1:
        return v[0] != ""
    if len(v) == 2 and v[0] in ("-z", "-n"):
        return (v[1] == "") == (v[0] == "-z")
    if len(v) == 3:
        a, op, b = v
        if op in ("=", "=="):
            return fnmatch.fnmatchcase(a, b) if "*" in b else a == b
        if op == "!=":
            return a != b
        ints = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__, "-gt": int.__gt__,
                "-ge": int.__ge__}
        if op in ints:
            return bool(ints[op](int(a), int(b)))
    raise ValueError(" ".join(v))
