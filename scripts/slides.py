#!/usr/bin/env python3
"""The lesson decks: slides/NN_name.md (Marp Markdown) -> build/slides/NN_name.{html,pdf}.

A deck is Marp Markdown plus three things this script fills in, so that a slide cannot drift
from the code it shows:

  <!-- code: lessons/02_ring_attention/main.cpp#ring-step -->
      the source lines between `[slide:ring-step]` and the next `[/slide]` (or
      `[/slide:ring-step]`) in that file, as a fenced code block; marker lines inside the
      excerpt are left out and the common indentation is removed
  <!-- run: L=05 NP=8 ARGS="--train 20" keep="^check:|PASS$" max=12 expect=0 -->
      the lesson run for real (make slides) and an excerpt of what it printed: the lines that
      match `keep` (all if absent), at most `max` (default 14), under its `make run` line; the
      run must exit with `expect` (default 0; 1 for a planted bug that fails the check)
  ![...](../plots/out/NAME.png)
      a figure from `make plots`; NAME must be a file a plots/*.py script writes

The front matter (Marp, the fivefold theme, KaTeX, page numbers, the footer) is added here.

  slides.py check [NN..] make test: every deck's markers, figures, runs and slide count are
                         checked statically, every slide against what a projected slide may
                         carry (words, code lines, speaker notes: PROJECT_WORDS below), and
                         every deck builds to HTML (no browser, no lesson runs: a run's excerpt
                         is its command line); every lesson has a deck and every deck a lesson
  slides.py build [NN..] make slides: the same, then the runs, HTML, PDF (with the speaker
                         notes) and one PNG per slide, index.html, then slides/check-render.mjs
                         (overflow, footer, code size) and the blank-slide check
  slides.py stats [NN..] the slides over those limits, deck by deck (words of body text, lines
                         of code)
SLIDES_OUT=DIR builds into DIR instead of build/slides (the runs' cache stays shared).
Each mode first shows its checks failing on decks made bad on purpose (the self-tests).
"""
import hashlib
import html
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLIDES = ROOT / "slides"
BUILD = ROOT / os.environ.get("BUILD", "build")
MARP = SLIDES / "node_modules" / ".bin" / "marp"
# A lesson deck covers its lesson in 8-15 slides, per part for a lesson taught in parts (lesson
# 08): each part opens with a title slide (`<!-- _class: lead -->`). Its last slide, "Your
# turn" (the lesson's exercises, scripts/exercise.py), is not counted.
MIN_SLIDES, MAX_SLIDES = 8, 15
DEFAULT_MAX_LINES = 14

CODE = re.compile(r"^<!--\s*code:\s*(\S+?)#([\w.-]+)\s*-->\s*$")
RUN = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->\s*$")
CODE_ANY = re.compile(r"<!--\s*code:\s*(\S+?)#([\w.-]+)\s*-->")
RUN_ANY = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")
FIGURE = re.compile(r"\]\(\.\./plots/out/([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
LANGS = {".cpp": "cpp", ".h": "cpp", ".cu": "cpp", ".py": "python", ".sh": "bash",
         ".mk": "makefile", "Makefile": "makefile"}


class DeckError(Exception):
    """One line: the deck, its line and what is wrong."""


def fail(deck, lineno, msg):
    raise DeckError(f"{deck.relative_to(ROOT)}:{lineno}: {msg}")


def lessons():
    """lessons/NN_name directories that exist, by number."""
    return sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*") if p.is_dir())


def decks(only=()):
    found = sorted(SLIDES.glob("[0-9][0-9]_*.md"))
    if only:
        found = [d for d in found if d.name[:2] in only]
    return found


# ---- code excerpts ------------------------------------------------------------------------
from exercise import EXERCISE_MARK  # noqa: E402 (scripts/exercise.py, beside this file)


def excerpt_lines(src, name):
    """The lines an excerpt shows, as a list, or a string saying why there are none. A C++
    excerpt that ends inside a block (its marker closes before the block does) shows `…` and
    the closing braces, so that a slide never shows an open block as if it were the whole."""
    lines = src.read_text().splitlines()
    begin = [i for i, l in enumerate(lines) if re.search(rf"\[slide:{re.escape(name)}\]", l)]
    if not begin:
        return f"marker [slide:{name}] not found in {src.relative_to(ROOT)}"
    if len(begin) > 1:
        return f"marker [slide:{name}] appears {len(begin)} times in {src.relative_to(ROOT)}"
    end_re = re.compile(rf"\[/slide(:{re.escape(name)})?\]")
    body = []
    for l in lines[begin[0] + 1:]:
        if end_re.search(l):
            break
        # slide and exercise marks, and an exercise's key lines, are not the code (scripts/exercise.py)
        if "[slide:" not in l and "[/slide" not in l and not EXERCISE_MARK.match(l):
            body.append(l)
    else:
        return f"marker [slide:{name}] in {src.relative_to(ROOT)} has no [/slide]"
    while body and not body[-1].strip():
        body.pop()
    if not body:
        return f"marker [slide:{name}] in {src.relative_to(ROOT)} encloses no code"
    indent = min(len(l) - len(l.lstrip()) for l in body if l.strip())
    body = [l[indent:] for l in body]
    if LANGS.get(src.suffix) == "cpp":
        open_at = []  # the indentation of each line that opened a block still open
        for l in body:
            code = re.sub(r"//.*$", "", re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', "", l))
            for ch in code:
                if ch == "{":
                    open_at.append(len(l) - len(l.lstrip()))
                elif ch == "}" and open_at:
                    open_at.pop()
        if open_at:
            body.append(" " * (open_at[-1] + 2) + "…")
            body += [" " * at + "}" for at in reversed(open_at)]
    return body


def excerpt(deck, lineno, path, name):
    src = ROOT / path
    if not src.is_file():
        fail(deck, lineno, f"code: no file {path}")
    body = excerpt_lines(src, name)
    if isinstance(body, str):
        fail(deck, lineno, f"code: {body}")
    lang = LANGS.get(src.suffix, LANGS.get(src.name, ""))
    return [f"```{lang}"] + body + ["```"]


# ---- lesson runs --------------------------------------------------------------------------
def parse_run(deck, lineno, spec):
    try:
        words = shlex.split(spec)
    except ValueError as e:
        fail(deck, lineno, f"run: cannot parse '{spec}': {e}")
    opts = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or key not in ("L", "NP", "ARGS", "keep", "max", "expect"):
            fail(deck, lineno, f"run: '{w}' is not one of L= NP= ARGS= keep= max= expect=")
        opts[key] = value
    if "L" not in opts:
        fail(deck, lineno, "run: L=NN is missing")
    lesson = [n for n in lessons() if n[:2] == opts["L"]]
    if not lesson:
        fail(deck, lineno, f"run: there is no lesson {opts['L']} (lessons: {', '.join(lessons())})")
    np = opts.get("NP") or (ROOT / "lessons" / lesson[0] / "NP").read_text().strip()
    for key in ("NP", "max", "expect"):
        if key in opts and not opts[key].isdigit():
            fail(deck, lineno, f"run: {key}={opts[key]} is not a number")
    try:
        keep = re.compile(opts.get("keep", ""))
    except re.error as e:
        fail(deck, lineno, f"run: keep='{opts['keep']}' is not a regular expression: {e}")
    shown = f"make run L={opts['L']}" + (f" NP={opts['NP']}" if "NP" in opts else "") + \
            (f" ARGS=\"{opts['ARGS']}\"" if opts.get("ARGS") else "")
    return dict(lesson=lesson[0], np=int(np), args=shlex.split(opts.get("ARGS", "")),
                keep=keep, max=int(opts.get("max", DEFAULT_MAX_LINES)),
                expect=int(opts.get("expect", 0)), shown=shown)


def run_output(deck, lineno, run, cache):
    """The lesson's output, run once per distinct command and build of the lesson (cached in
    build/slides/runs, keyed by the command and the binary's modification time: a rebuilt
    lesson runs again)."""
    mpirun = shlex.split(os.environ.get("MPIRUN", "mpirun --oversubscribe -q"))
    binary = BUILD / "bin" / run["lesson"]
    if not binary.exists():
        fail(deck, lineno, f"run: {binary.relative_to(ROOT)} is not built: run make first")
    cmd = mpirun + ["-np", str(run["np"]), str(binary)] + run["args"]
    key = hashlib.sha1((" ".join(cmd) + f" {binary.stat().st_mtime_ns}").encode()).hexdigest()[:16]
    path = cache / f"{key}.txt"
    if not path.exists():
        print(f"+ {run['shown']}", flush=True)
        # a run that saves checkpoints shows a first run: lesson 08 saves only into a directory
        # without another run's checkpoints
        for flag, value in zip(run["args"], run["args"][1:]):
            if flag == "--save" and value.startswith("/tmp/fivefold-"):
                shutil.rmtree(value, ignore_errors=True)
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=600)
        if p.returncode != run["expect"]:
            tail = "\n".join(p.stdout.splitlines()[-10:])
            fail(deck, lineno, f"run: {run['shown']} exited {p.returncode}, "
                               f"expected {run['expect']}:\n{tail}")
        path.write_text(p.stdout)
    lines = [l for l in path.read_text().splitlines() if run["keep"].search(l)]
    if not lines:
        fail(deck, lineno, f"run: no line of {run['shown']} matches keep='{run['keep'].pattern}'")
    if len(lines) > run["max"]:
        lines = lines[:run["max"] - 1] + ["…"]
    return lines


# ---- figures ------------------------------------------------------------------------------
def figures_written():
    """Every NAME.png a plots/*.py script names (the figures make plots can produce), mapped
    to the lesson whose runs draw it (the script's NN_ prefix: scripts/make-plots.sh NN)."""
    names = {}
    for script in sorted((ROOT / "plots").glob("*.py")):
        for name in re.findall(r"([\w.-]+\.png)", script.read_text()):
            names[name] = script.name[:2]
    return names


def draw_missing_figures(todo):
    """make slides on a fresh tree: runs make-plots.sh for the lessons whose figures the decks
    show and plots/out/ lacks. A failure is a DeckError naming the lessons."""
    written, need = figures_written(), set()
    for deck in todo:
        for name in FIGURE.findall(deck.read_text()):
            if name in written and not (ROOT / "plots" / "out" / name).is_file():
                need.add(written[name])
    if not need:
        return
    print(f"drawing the figures the decks lack: scripts/make-plots.sh {' '.join(sorted(need))}",
          flush=True)
    if subprocess.run(["bash", str(ROOT / "scripts" / "make-plots.sh"), *sorted(need)]).returncode:
        raise DeckError(f"make-plots.sh {' '.join(sorted(need))} failed: the figures are missing")


# ---- one deck -----------------------------------------------------------------------------
def front_matter(deck):
    number = deck.name[:2]
    footer = "fivefold" if number == "00" else f"fivefold · lesson {number}"
    return ["---", "marp: true", "theme: fivefold", "math: katex", "paginate: true",
            f"footer: '{footer}'", "---", ""]


def render(deck, mode, cache, figdir):
    """The deck with its directives filled in; mode 'check' runs nothing."""
    out, figures, slides, fenced, parts = [], figures_written(), 1, False, 0
    lines = deck.read_text().splitlines()
    if lines and lines[0].strip() == "---":
        fail(deck, 1, "no front matter in a deck: slides.py adds it (theme, math, footer)")
    for lineno, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
        if fenced:
            out.append(line)
            continue
        if line.strip() == "---":
            slides += 1
        if line.strip() == "<!-- _class: lead -->":
            parts += 1
        if m := CODE.match(line):
            out += excerpt(deck, lineno, m.group(1), m.group(2))
            continue
        if m := RUN.match(line):
            run = parse_run(deck, lineno, m.group(1))
            body = ["(the output is captured by make slides)"] if mode == "check" else \
                run_output(deck, lineno, run, cache)
            out += ["```text", f"$ {run['shown']}"] + body + ["```"]
            continue
        if line.lstrip().startswith("<!--") and re.match(r"^\s*<!--\s*(code|run)\b", line):
            fail(deck, lineno, "malformed directive: <!-- code: PATH#NAME --> or <!-- run: L=NN ... -->")
        for name in FIGURE.findall(line):
            if name not in figures:
                fail(deck, lineno, f"figure {name}: no plots/*.py script writes it")
            src = ROOT / "plots" / "out" / name
            if mode == "build":
                if not src.is_file():
                    fail(deck, lineno, f"figure plots/out/{name} is missing: run make plots "
                                       f"(make lecture runs both)")
                shutil.copyfile(src, figdir / name)
        out.append(FIGURE.sub(lambda m: f"](figures/{m.group(1)})", line))
    if fenced:
        fail(deck, len(lines), "a code fence is never closed")
    projectable(deck, lines)
    parts = max(parts, 1)
    if any(l.strip() == "# Your turn" for l in lines):
        slides -= 1
    if deck.name[:2] != "00" and not MIN_SLIDES * parts <= slides <= MAX_SLIDES * parts:
        fail(deck, 1, f"{slides} slides: a lesson deck has {MIN_SLIDES} to {MAX_SLIDES}"
                      + (f" per part ({parts} parts: {MIN_SLIDES * parts} to {MAX_SLIDES * parts})"
                         if parts > 1 else " (per part: a part opens with a lead slide)"))
    return front_matter(deck) + out, slides


def title_of(deck):
    for line in deck.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return deck.stem


def marker_ranges(lines):
    """{name: (first line, last line)} of every [slide:NAME] in a file, as excerpt_lines reads it:
    from its marker to the next [/slide] or [/slide:NAME] (1-based; last None: never closed)."""
    out = {}
    for i, l in enumerate(lines):
        for m in re.finditer(r"\[slide:([\w-]+)\]", l):
            end_re = re.compile(rf"\[/slide(:{re.escape(m.group(1))})?\]")
            end = next((j for j in range(i + 1, len(lines)) if end_re.search(lines[j])), None)
            out[m.group(1)] = (i + 1, None if end is None else end + 1)
    return out


def crossing_markers(path, lines):
    """Two excerpts of one file that overlap without one holding the other: a reader of the code
    cannot tell where either is (each problem names the file, the lines and both markers)."""
    ranges = sorted((a, b, n) for n, (a, b) in marker_ranges(lines).items() if b is not None)
    out = []
    for i, (a1, b1, n1) in enumerate(ranges):
        for a2, b2, n2 in ranges[i + 1:]:
            if a1 < a2 <= b1 < b2:
                out.append(f"{path}:{a2}: [slide:{n2}] (lines {a2}-{b2}) crosses [slide:{n1}] (lines {a1}-{b1}): "
                           f"excerpts nest or stay apart")
    return out


def check_markers_nest():
    """Every source file's [slide:] excerpts nest or stay apart."""
    problems = []
    for top in ("lessons", "common", "kernels"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".cpp", ".h", ".cu", ".cuh") and "[slide:" in path.read_text():
                problems += crossing_markers(path.relative_to(ROOT), path.read_text().splitlines())
    return problems


def check_lessons_have_decks():
    have = {d.stem for d in decks()}
    missing = [n for n in lessons() if n not in have]
    orphans = [d for d in have if d != "00_course" and d not in lessons()]
    problems = [f"slides/{n}.md: lesson {n} has no deck" for n in missing]
    problems += [f"slides/{d}.md: no lesson {d} (decks exist only for lessons that do)"
                 for d in orphans]
    if "00_course" not in have:
        problems.append("slides/00_course.md: the course deck is missing")
    return problems


def chrome_env():
    return dict(os.environ, CHROME_PATH=os.environ.get("CHROME_PATH", "/usr/bin/chromium"))


def marp(*args):
    env = chrome_env()
    cmd = [str(MARP), "--no-config-file", "--allow-local-files",
           "--theme-set", str(SLIDES / "fivefold.css"), *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise DeckError("marp failed: " + " ".join(map(str, args)) + "\n" + p.stdout)
    return p.stdout


def write_index(out, built):
    rows = "\n".join(
        f'<li><a href="{d.stem}.html">{html.escape(title_of(d))}</a>'
        f' · <a href="{d.stem}.pdf">PDF</a></li>' for d in built)
    (out / "index.html").write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fivefold — the lectures</title>
<style>body {{ font: 18px/1.5 sans-serif; max-width: 46em; margin: 3em auto; }}
li {{ margin: 0.4em 0; }}</style></head>
<body><h1>fivefold — the lectures</h1>
<p>One deck per lesson, built by <code>make slides</code> from the code, real runs and
<code>make plots</code>'s figures.</p>
<ol start="0">
{rows}
</ol></body></html>
""")


def blank_slides(pngs):
    """Slides whose PNG is (nearly) a single colour."""
    import matplotlib.image as mpimg  # Debian's python3-matplotlib (and numpy)
    blank = []
    for png in pngs:
        img = mpimg.imread(png)[..., :3]
        if img.std() < 0.01:
            blank.append(png)
    return blank


def static_self_test(out):
    """make test's checks must be able to fail: a deck naming a marker its file lacks, a
    figure no plot script writes, a lesson that does not exist, or an unclosed marker, is an
    error naming the deck, the line and the name."""
    test = out / "self-test"
    test.mkdir(parents=True, exist_ok=True)
    (test / "source.cpp").write_text("// [slide:open]\nint x;\n")
    cases = [("<!-- code: common/core/check.h#no-such-marker -->", "no-such-marker"),
             ("![w:900](../plots/out/no_such_figure.png)", "no_such_figure.png"),
             ("<!-- run: L=99 -->", "no lesson 99"),
             (f"<!-- code: {test.relative_to(ROOT)}/source.cpp#open -->", "has no [/slide]")]
    for n, (line, name) in enumerate(cases):
        deck = test / f"00_bad{n}.md"
        deck.write_text("# A slide\n\n" + line + "\n")
        try:
            render(deck, "check", out, out)
        except DeckError as e:
            want = f"{deck.relative_to(ROOT)}:3: "
            if str(e).startswith(want) and name in str(e):
                continue
            raise DeckError(f"static self-test: '{line}' gave '{e}', not '{want}…{name}…'")
        raise DeckError(f"static self-test: '{line}' was not caught")
    notes = "<!-- What the lecturer says here, in a dozen words or more: the notes. -->"
    heavy = [("# Heavy\n\n" + "word " * (PROJECT_WORDS + 1) + "\n" + notes, f"{PROJECT_WORDS + 1} words"),
             ("# Long\n\n```\n" + "x\n" * (PROJECT_CODE_LINES + 1) + "```\n" + notes,
              f"{PROJECT_CODE_LINES + 1} lines of code"),
             ("# Mute\n\n<!-- _class: x -->\n<!-- a few words -->\n", "speaker notes of 3 words")]
    for n, (text, name) in enumerate(heavy):
        deck = test / f"00_heavy{n}.md"
        deck.write_text(text)
        try:
            render(deck, "check", out, out)
        except DeckError as e:
            if str(e).startswith(f"{deck.relative_to(ROOT)}:1: ") and name in str(e):
                continue
            raise DeckError(f"static self-test: {deck.name} gave '{e}', not '…{name}…'")
        raise DeckError(f"static self-test: {deck.name} ({name}) was not caught")
    crossed = crossing_markers("x.cpp", ["// [slide:a]", "int x;", "// [slide:b]", "int y;", "// [/slide:a]",
                                         "int z;", "// [/slide]"])
    nested = crossing_markers("y.cpp", ["// [slide:a]", "// [slide:b]", "int y;", "// [/slide:b]", "int z;",
                                        "// [/slide:a]"])
    if len(crossed) != 1 or "[slide:b] (lines 3-7) crosses [slide:a] (lines 1-5)" not in crossed[0] or nested:
        raise DeckError(f"static self-test: crossing markers gave {crossed}, nested ones {nested}")
    print(f"  self-test: {len(cases)} bad references caught, each naming its deck, line and name; "
          f"a slide too wordy, one with too much code, one without notes and two crossing excerpts caught")


def self_test(out):
    """make slides' checks must be able to fail: a deck with a slide too tall, a code line too
    wide (lines kept unwrapped), code set too small, a box reaching into the footer and a blank
    slide must be reported as exactly those five."""
    test = out / "self-test"
    test.mkdir(exist_ok=True)
    tall = ["# Too tall"] + [f"- item {i}" for i in range(30)]
    wide = ["<style scoped>pre, pre code { white-space: pre; }</style>", "", "# Too wide", "```cpp",
            "int x = " + "1 + " * 60 + "1;", "```"]
    small = ["<style scoped>pre { font-size: 14px; }</style>", "", "# Too small", "```cpp",
             "int x = 1;", "```"]
    footer = ['<div style="height: 650px; background: #ddd;"></div>']
    deck = front_matter(Path("00_self_test.md"))
    for slide in (tall, wide, small, footer):
        deck += slide + ["", "---", ""]
    (test / "00_self_test.md").write_text("\n".join(deck) + "\n")
    marp("--html", "--images", "png", test / "00_self_test.md")
    marp("--html", "--template", "bare", test / "00_self_test.md")
    blank = [int(p.name.split(".")[1]) for p in blank_slides(sorted(test.glob("*.png")))]
    r = subprocess.run(["node", str(SLIDES / "check-render.mjs"), str(test / "00_self_test.html")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=chrome_env())
    caught = {int(n): what for n, what in re.findall(r"slide (\d+): (.*)", r.stdout)}
    want = {1: "outside the slide", 2: "wider than the block", 3: "below the", 4: "into the footer"}
    if blank != [5] or sorted(caught) != sorted(want) or r.returncode != 1 or \
            any(want[n] not in caught[n] for n in want):
        raise DeckError(f"the render check's self-test: expected slide 1 too tall, 2 too wide, 3 "
                        f"too small, 4 in the footer and 5 blank, found {caught}, blank {blank}:\n{r.stdout}")
    print("  self-test: a slide too tall, a code line too wide, code too small, a box in the footer "
          "and a blank slide are caught")


# What a slide projected in a lecture room may carry (checked on every slide by `check` and
# `build`): at most this many words of body text outside notes, code blocks and headings, and
# this many lines of code (a `code:` excerpt, a fenced block, a run's excerpt: its `max`). The
# rest of what the lecturer says goes to the slide's speaker notes: an HTML comment that is not
# a directive (`<!-- _class: lead -->`, `code:`, `run:`), at least NOTE_WORDS words on every
# slide but a part's title slide and "Your turn".
PROJECT_WORDS, PROJECT_CODE_LINES, NOTE_WORDS = 60, DEFAULT_MAX_LINES, 12
DIRECTIVE = re.compile(r"^\s*_?[A-Za-z]+\s*:")  # `key: value` comments are Marp's (or ours)


def notes_of(text):
    """The speaker notes of one slide's Markdown: its comments that are not directives."""
    fenceless = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [c.strip() for c in re.findall(r"<!--(.*?)-->", fenceless, flags=re.S)
            if not DIRECTIVE.match(c)]


def slides_of(lines):
    """(first line number, Markdown) of every slide of a deck's lines."""
    out, start, fenced, cur = [], 1, False, []
    for lineno, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and line.strip() == "---":
            out.append((start, "\n".join(cur)))
            start, cur = lineno + 1, []
            continue
        cur.append(line)
    out.append((start, "\n".join(cur)))
    return out


def projectable(deck, lines):
    """Fails naming every slide too heavy to project or without its speaker notes."""
    problems = []
    for start, text in slides_of(lines):
        words, code = slide_load(text)
        title = slide_title(text)
        if words > PROJECT_WORDS or code > PROJECT_CODE_LINES:
            problems.append((start, f"slide '{title}': {words} words of body text and {code} lines of code; "
                              f"a projected slide has at most {PROJECT_WORDS} and {PROJECT_CODE_LINES} "
                              f"(move the prose to its speaker notes, <!-- ... -->, or split the slide)"))
        lead = "_class: lead" in text
        noted = sum(len(n.split()) for n in notes_of(text))
        if not lead and title != "Your turn" and noted < NOTE_WORDS:
            problems.append((start, f"slide '{title}': speaker notes of {noted} words; every slide but a "
                              f"title slide and 'Your turn' has at least {NOTE_WORDS} (<!-- ... -->: "
                              f"what the lecturer says that the slide does not)"))
    if problems:
        raise DeckError("\nerror: ".join(f"{deck.relative_to(ROOT)}:{n}: {m}" for n, m in problems))


def slide_title(text):
    """A slide's `# title` (the line slide_load leaves out of its words), or ""."""
    return next((l[2:].strip() for l in text.splitlines() if l.startswith("# ")), "")


def slide_load(text):
    """(words of body text, lines of code) of one slide's Markdown."""
    code = 0
    for m in CODE_ANY.finditer(text):
        path, name = m.groups()
        src = ROOT / path
        if src.is_file():
            body = excerpt_lines(src, name)
            code += len(body) if isinstance(body, list) else 0
    for m in RUN_ANY.finditer(text):
        code += int(dict(re.findall(r'(\w+)=("[^"]*"|\S+)', m.group(1))).get("max", DEFAULT_MAX_LINES))
    fences = re.findall(r"^```.*?^```", text, flags=re.S | re.M)
    code += sum(f.count("\n") - 1 for f in fences)
    body = re.sub(r"<!--.*?-->", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.S)
    body = re.sub(r"^# .*$", "", body, count=1, flags=re.M)  # the title; subheadings count
    return len(re.findall(r"[A-Za-z0-9][\w'’.-]*", body)), code


def stats(only):
    """slides.py stats [NN..]: the slides over PROJECT_WORDS words of body text or
    PROJECT_CODE_LINES lines of code, deck by deck (what a projectable deck must cut)."""
    heavy = total = 0
    for deck in decks(only):
        for i, (_, text) in enumerate(slides_of(deck.read_text().splitlines())):
            total += 1
            words, code = slide_load(text)
            if words > PROJECT_WORDS or code > PROJECT_CODE_LINES:
                heavy += 1
                title = slide_title(text)
                print(f"{deck.name} slide {i}: {words} words, {code} code lines  {title[:60]}")
    print(f"{heavy} of {total} slides over {PROJECT_WORDS} words or {PROJECT_CODE_LINES} code lines")
    return 0


def main(argv):
    if argv and argv[0] == "stats":
        return stats(argv[1:])
    if not argv or argv[0] not in ("check", "build"):
        print("usage: slides.py check | build | stats [NN ...]   (see the top of scripts/slides.py)",
              file=sys.stderr)
        return 2
    mode, only = argv[0], argv[1:]
    if not MARP.exists():
        print("error: slides/node_modules has no marp: run scripts/install-deps.sh", file=sys.stderr)
        return 2
    # SLIDES_OUT: another output folder (decks built side by side); the runs' cache is shared
    out = (ROOT / os.environ.get("SLIDES_OUT", BUILD / ("slides-check" if mode == "check" else "slides"))).resolve()
    cache, figdir = BUILD / "slides" / "runs", out / "figures"
    for d in (out, cache, figdir):
        d.mkdir(parents=True, exist_ok=True)
    problems = check_lessons_have_decks() if not only else []
    todo = decks(only)
    if only and len(todo) != len(only):
        problems.append(f"no deck for {' '.join(only)} in slides/")
    if mode == "check":
        problems += check_markers_nest()
        try:
            static_self_test(out)
        except DeckError as e:
            problems.append(str(e))
    if mode == "build":
        try:
            draw_missing_figures(todo)
        except DeckError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    built = []
    for deck in todo:
        try:
            text, n = render(deck, mode, cache, figdir)
        except DeckError as e:
            problems.append(str(e))
            continue
        (out / deck.name).write_text("\n".join(text) + "\n")
        built.append(deck)
        print(f"  {deck.name}: {n} slides")
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 1
    # marp writes each output next to its source when given several files
    sources = [out / d.name for d in built]
    try:
        marp("--html", *sources)
        if mode == "build":
            self_test(out)
            # one deck per browser: with every deck in one call, marp's parallel workers can
            # time out on a 2-core machine
            for src in sources:
                marp("--pdf", "--pdf-notes", src)
            pngdir, bare = out / "png", out / "bare"
            for d in (pngdir, bare):
                d.mkdir(exist_ok=True)
            for d in built:  # a deck that lost slides must not keep its old PNGs
                for png in pngdir.glob(f"{d.stem}.[0-9]*.png"):
                    png.unlink()
            for src in sources:
                marp("--images", "png", src)
            for d in built:
                for png in out.glob(f"{d.stem}.[0-9]*.png"):
                    png.rename(pngdir / png.name)
            # every slide laid out on one page, for the overflow check in a browser
            if not (bare / "figures").exists():
                (bare / "figures").symlink_to("../figures")
            for src in sources:
                shutil.copyfile(src, bare / src.name)
            marp("--html", "--template", "bare", *[bare / s.name for s in sources])
    except DeckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if mode == "check":
        print(f"slides ok: {len(built)} decks build to HTML")
        return 0
    write_index(out, decks())
    pngs = sorted((out / "png").glob("*.png"))
    blank = blank_slides([p for p in pngs if p.name.split(".")[0] in {d.stem for d in built}])
    for p in blank:
        deck, number = p.name.split(".")[:2]
        print(f"error: slides/{deck}.md: slide {int(number)} is blank", file=sys.stderr)
    r = subprocess.run(["node", str(SLIDES / "check-render.mjs")] +
                       [str(out / "bare" / f"{d.stem}.html") for d in built], env=chrome_env())
    if blank or r.returncode != 0:
        return 1
    print(f"slides ok: {len(built)} decks in {out.relative_to(ROOT)}/ "
          f"(HTML, PDF, {len(pngs)} slide PNGs in png/), index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
