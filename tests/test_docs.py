"""The documentation resolves and its commands run.

Links: every relative link in README.md, CHANGELOG.md and docs/*.md points to a file of the repository (and, for
links into a Markdown page, to one of its headings); every `docs/...` path cited in code, configs, tests and tools
exists; nothing cites files outside the repository.

Commands: every ```bash block of README.md and docs/*.md is read line by line (comments dropped, `\\` continuations
joined, `VAR=value` prefixes and earlier `A="..."` assignments of the block applied) and each command is checked
without running it:

* `python SCRIPT ARGS`: the script exists (in the repository, run from its root), and the script's own argparse
  parser (captured when its `parse_args` / `main` calls `parse_args`) accepts ARGS exactly as written;
* `bash SCRIPT ARGS`: the script exists and `bash -n` parses it;
* `mim train|test PKG CONFIG ARGS`: the package is installed, mim finds its tools/train.py / test.py
  (`<pkg>/.mim/tools/` or `<pkg>/tools/`), and that tool's parser accepts CONFIG ARGS; `mim run PKG [DOMAIN:]CMD
  ARGS`: mim finds exactly one script for CMD and its parser accepts ARGS; `mim search PKG`: PKG is installed;
* `pip install -e .[EXTRA]`: setup.py declares EXTRA;
* every config named (`configs/....py`, `mmdet::....py`) exists and loads with `Config.fromfile`;
* `git`, `wget`, `mkdir`, `cd`, `export` lines: nothing is checked beyond the above (their arguments are the user's).

A block whose lines show a tool's usage with placeholders (CONFIG, CKPT, `[--opt ...]`) rather than a command to run
is marked by the HTML comment `<!-- docs-test: synopsis -->` on the line before its fence; for it only the scripts
(they exist) and the option names (each `--opt` is one the tool's parser knows) are checked. Blocks in other
languages (```python, ```text, unlabelled) are not commands. Commands quoted in the prose (a code span starting
with `python `, `bash ` or `mim `) are checked as synopses; `a|b` alternatives of a mim span are checked each.
Paths of data, checkpoints and outputs are the user's and are not checked; configs and scripts of the repository
and of the installed libraries are.
"""
import argparse
import contextlib
import glob
import importlib.util
import io
import os.path as osp
import re
import shlex
import subprocess
import sys
from unittest import mock

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
PAGES = ['README.md', 'CHANGELOG.md'] + sorted(osp.relpath(p, ROOT) for p in glob.glob(osp.join(ROOT, 'docs', '*.md')))
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
CODE_DIRS = ['configs', 'tests', 'tools', 'mmplugin_l2']
DOC_PATH = re.compile(r'(?<![\w/.])docs/[\w./-]*\w')


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r'[^\w\- ]', '', s)
    return s.replace(' ', '-')


def anchors(path):
    text = open(path, encoding='utf-8').read()
    text = re.sub(r'```.*?```', '', text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r'^#+\s+(.*)$', text, flags=re.M)}


def links(page):
    text = open(osp.join(ROOT, page), encoding='utf-8').read()
    text = re.sub(r'```.*?```', '', text, flags=re.S)  # code blocks are not links
    return [m.group(1) for m in LINK.finditer(text)]


def test_pages_exist():
    for need in ('get_started', 'hvit3', 'l2vit', 'rest', 'tools', 'benchmark', 'mixed_precision', 'reliability'):
        assert f'docs/{need}.md' in PAGES, f'docs/{need}.md is missing'


@pytest.mark.parametrize('page', PAGES)
def test_relative_links_resolve(page):
    bad = []
    for url in links(page):
        if re.match(r'^[a-z]+:', url):  # http(s), mailto
            continue
        target, _, anchor = url.partition('#')
        path = osp.normpath(osp.join(ROOT, osp.dirname(page), target)) if target else osp.join(ROOT, page)
        if not osp.exists(path):
            bad.append(f'{url} (no file {osp.relpath(path, ROOT)})')
        elif anchor and path.endswith('.md') and anchor not in anchors(path):
            bad.append(f'{url} (no heading #{anchor} in {osp.relpath(path, ROOT)})')
    assert not bad, f'{page}: broken links: {bad}'


def code_files():
    for d in CODE_DIRS:
        for p in glob.glob(osp.join(ROOT, d, '**', '*'), recursive=True):
            if '.mim' in p.split(osp.sep) or '__pycache__' in p:
                continue
            if osp.isfile(p) and p.endswith(('.py', '.sh', '.yml', '.md', '.txt')):
                yield p


def test_docs_paths_cited_in_code_exist():
    missing = {}
    for p in code_files():
        for m in DOC_PATH.finditer(open(p, encoding='utf-8', errors='replace').read()):
            cited = m.group(0).rstrip('.')
            if not osp.exists(osp.join(ROOT, cited)):
                missing.setdefault(cited, []).append(osp.relpath(p, ROOT))
    assert not missing, f'docs paths cited but not in the repository: {missing}'


def test_nothing_cites_files_outside_the_repository():
    hits = []
    for p in list(code_files()) + [osp.join(ROOT, f) for f in PAGES]:
        if osp.samefile(p, __file__):
            continue
        text = open(p, encoding='utf-8', errors='replace').read()
        for bad in ('shared' + '/reference', 'reference section', '/work/'):  # split: not a citation itself
            if bad in text:
                hits.append(f'{osp.relpath(p, ROOT)}: {bad!r}')
    assert not hits, hits


def test_readme_is_short():
    n = len(open(osp.join(ROOT, 'README.md'), encoding='utf-8').read().splitlines())
    assert n <= 200, f'README.md has {n} lines; the details belong in docs/'


# ---------------------------------------------------------------------------------------------------------------
# The commands of the pages
SHELL_LANGS = ('bash', 'sh', 'shell')
SYNOPSIS = '<!-- docs-test: synopsis -->'
FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```', re.S | re.M)
PLAIN_COMMANDS = ('git', 'wget', 'mkdir', 'cd', 'export')


def command_blocks():
    """(page, line, synopsis, text) of every shell block of README.md and docs/*.md."""
    for page in ['README.md'] + [p for p in PAGES if p.startswith('docs/')]:
        text = open(osp.join(ROOT, page), encoding='utf-8').read()
        for m in FENCE.finditer(text):
            if m.group(1) not in SHELL_LANGS:
                continue
            before = text[:m.start()].rstrip('\n').rsplit('\n', 1)[-1].strip()
            yield page, text[:m.start()].count('\n') + 1, before == SYNOPSIS, m.group(2)


def split_commands(block, synopsis=False):
    """The commands of a block: comments dropped, continuations joined, `&&` / `;` split (a synopsis: one command
    a line, split at white space, its `|` and brackets kept)."""
    joined = re.sub(r'\\\n', ' ', block)
    cmds = []
    for line in joined.splitlines():
        if synopsis:
            toks = re.sub(r'(^|\s)#.*', '', line).split()
            if toks:
                cmds.append(toks)
            continue
        try:
            lex = shlex.shlex(line, posix=True, punctuation_chars=';&|')
            lex.whitespace_split = True
            lex.commenters = '#'
            toks = list(lex)
        except ValueError as err:
            raise AssertionError(f'cannot split {line!r}: {err}')
        cur = []
        for tok in toks:
            if tok in (';', '&&', '||', '|', '&'):
                if cur:
                    cmds.append(cur)
                cur = []
            else:
                cur.append(tok)
        if cur:
            cmds.append(cur)
    return cmds


class _Captured(Exception):
    pass


_PARSERS = {}


def tool_parser(script):
    """The argparse parser a script builds, captured at its `parse_args` call (the script is imported, not run)."""
    script = osp.realpath(script)
    if script not in _PARSERS:
        name = '_docs_tool_' + re.sub(r'\W', '_', osp.relpath(script, '/'))
        spec = importlib.util.spec_from_file_location(name, script)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, osp.dirname(script))
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(osp.dirname(script))
        captured = []

        def capture(self, args=None, namespace=None):
            captured.append(self)
            raise _Captured

        entry = getattr(mod, 'parse_args', None) or getattr(mod, 'main')
        with mock.patch.object(argparse.ArgumentParser, 'parse_args', capture), \
                mock.patch.object(sys, 'argv', [script]):
            try:
                entry()
            except _Captured:
                pass
        assert captured, f'{script}: no argparse parser found (parse_args / main did not call parse_args)'
        _PARSERS[script] = captured[0]
    return _PARSERS[script]


def parser_accepts(script, args):
    """'' when the script's parser accepts args as they are, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            tool_parser(script).parse_args(args)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f'exit {e.code}'
    return ''


def unknown_options(script, args):
    parser = tool_parser(script)
    for action in parser._actions:  # a sub-command (`tool.py run --opt`): that sub-parser's options
        if isinstance(action, argparse._SubParsersAction) and args and args[0] in action.choices:
            parser, args = action.choices[args[0]], args[1:]
    known = parser._option_string_actions
    return [a for a in args if a.startswith('--') and a.split('=')[0].strip('[]|.') not in known
            and a.strip('[]|.') != '--']


def check_config(path):
    from mmengine.config import Config
    if '::' in path:  # an installed library's config: <pkg>/.mim/configs/<rest>
        pkg, _, rest = path.partition('::')
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            return f'config {path}: package {pkg} is not installed'
        full = osp.join(osp.dirname(spec.origin), '.mim', 'configs', rest)
    else:
        full = osp.join(ROOT, path)
    if not osp.exists(full):
        return f'config {path} does not exist ({full})'
    try:
        Config.fromfile(full)
    except Exception as err:  # noqa: BLE001 -- any failure to load is the finding
        return f'config {path} does not load: {type(err).__name__}: {str(err).splitlines()[0][:200]}'
    return ''


def mim_script(pkg, command):
    """The script `mim train|test|run PKG COMMAND` runs, or an error string."""
    from mim.utils import get_installed_path, module_full_name
    try:
        root = get_installed_path(module_full_name(pkg) or pkg)  # mim's own resolution (mmseg: mmsegmentation)
    except Exception as err:  # noqa: BLE001
        return None, f'mim: package {pkg} not installed ({err})'
    domain, _, name = command.rpartition(':')
    hits = []
    for tools in (osp.join(root, '.mim', 'tools'), osp.join(root, 'tools')):
        if osp.isdir(tools):
            for p in glob.glob(osp.join(tools, '**', name + '.py'), recursive=True):
                if osp.relpath(osp.dirname(p), tools).replace(osp.sep, ':').strip('.') == domain.strip('.') \
                        or (not domain and command in ('train', 'test') and osp.dirname(p) == tools) \
                        or (not domain and command not in ('train', 'test')):
                    hits.append(p)
            if hits:
                break
    if command in ('train', 'test'):
        hits = [p for p in hits if osp.basename(osp.dirname(p)) == 'tools']
    if len(hits) != 1:
        return None, f'mim: {len(hits)} scripts for {pkg} {command} ({hits}); name it DOMAIN:{name}'
    return hits[0], ''


MIM_OPTIONS = ('--gpus', '--gpus-per-node', '--cpus-per-task', '--partition', '--launcher', '--port', '--srun-args')


def drop_mim_options(args):
    """The arguments mim passes on to the tool: mim train / test's own options (and their values) removed."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.split('=')[0] in MIM_OPTIONS:
            skip = '=' not in a
        elif a not in ('-y', '--yes'):
            out.append(a)
    return out


def installed(pkg):
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        distribution(pkg)
        return True
    except PackageNotFoundError:
        return False


def check_command(cmd, synopsis, env):
    """The problems of one command (a list of tokens)."""
    while cmd and re.match(r'^[A-Za-z_][A-Za-z0-9_]*=', cmd[0]):
        k, _, v = cmd[0].partition('=')
        env[k] = v
        cmd = cmd[1:]
    if not cmd:
        return []
    # $VAR of an assignment earlier in the block
    cmd = [t for tok in cmd for t in (shlex.split(env[tok[1:]]) if tok.startswith('$') and tok[1:] in env
                                      else [tok])]
    prog, args = cmd[0], cmd[1:]
    problems = []
    configs = [a for a in args if re.match(r'^(configs/|\w+::).*\.py$', a)]
    if not synopsis:
        problems += [p for p in map(check_config, configs) if p]
    if prog == 'python':
        script = args[0]
        path = osp.join(ROOT, script)
        if not osp.isfile(path):
            return problems + [f'no script {script} (commands run from the repository root)']
        if synopsis:
            bad = unknown_options(path, args[1:])
            return problems + ([f'{script}: options its parser does not know: {bad}'] if bad else [])
        msg = parser_accepts(path, args[1:])
        return problems + ([f'{script} rejects the arguments: {msg}'] if msg else [])
    if prog == 'bash':
        path = osp.join(ROOT, args[0])
        if not osp.isfile(path):
            return problems + [f'no script {args[0]}']
        r = subprocess.run(['bash', '-n', path], capture_output=True, text=True)
        return problems + ([f'{args[0]}: bash -n: {r.stderr.strip()}'] if r.returncode else [])
    if prog == 'mim':
        sub, pkg, rest = args[0], args[1], args[2:]
        if sub in ('search', 'list', 'install', 'uninstall', 'download'):
            return problems + ([] if installed(pkg) else [f'mim {sub}: {pkg} is not installed'])
        if sub == 'run':
            script, err = mim_script(pkg, rest[0])
            rest = rest[1:]
        elif sub in ('train', 'test'):
            script, err = mim_script(pkg, sub)
            if sub == 'test' and '--checkpoint' in rest:  # mim's option, passed on as the tool's positional
                i = rest.index('--checkpoint')
                rest = rest[:1] + [rest[i + 1]] + rest[1:i] + rest[i + 2:]
            rest = drop_mim_options(rest)
        else:
            return problems + [f'mim {sub}: not a command this test knows']
        if err:
            return problems + [err]
        if synopsis:
            bad = unknown_options(script, rest)
            return problems + ([f'mim {sub} {pkg}: options its tool does not know: {bad}'] if bad else [])
        msg = parser_accepts(script, rest)
        return problems + ([f'mim {sub} {pkg} ({script}) rejects the arguments: {msg}'] if msg else [])
    if prog == 'pip':
        for a in args:
            m = re.match(r'^\.\[([\w,-]+)\]$', a)
            if m:
                setup = open(osp.join(ROOT, 'setup.py'), encoding='utf-8').read()
                for extra in m.group(1).split(','):
                    if not re.search(rf"['\"]{re.escape(extra)}['\"]\s*[:\]]", setup) and \
                            not re.search(rf"\b{re.escape(extra)}\s*=", setup):
                        problems.append(f'pip: setup.py declares no extra [{extra}]')
        return problems
    if prog in PLAIN_COMMANDS:
        return problems
    return problems + [f'{prog}: a command this test does not know (python, bash, mim, pip, {PLAIN_COMMANDS})']


BLOCKS = list(command_blocks())
INLINE = re.compile(r'`((?:python|bash|mim) [^`]+)`')


def inline_commands():
    """(page, line, command) of every `python ...` / `bash ...` / `mim ...` code span in the prose."""
    for page in ['README.md'] + [p for p in PAGES if p.startswith('docs/')]:
        text = open(osp.join(ROOT, page), encoding='utf-8').read()
        prose = FENCE.sub(lambda m: '\n' * m.group(0).count('\n'), text)
        for m in INLINE.finditer(prose.replace('\n', ' ')):
            yield page, prose[:m.start()].count('\n') + 1, m.group(1)


def test_inline_commands_of_the_docs():
    """Commands quoted in the prose are checked as synopses: the scripts exist, each option is one the tool knows,
    the configs named exist and load."""
    problems = []
    for page, line, cmd in inline_commands():
        toks = cmd.split()
        if toks[0] == 'python' and toks[1] in ('-m', '-c'):
            continue
        if toks[0] == 'mim':  # `mim train`: a mention; `mim train|test mmdet|mmsegmentation`: each alternative
            if len(toks) < 3:
                continue
            variants = [[toks[0], s, k] + toks[3:] for s in toks[1].split('|') for k in toks[2].split('|')]
        else:
            variants = [toks]
        for v in variants:
            for p in check_command(v, True, {}):
                problems.append(f'{page}:{line}: `{cmd}`: {p}')
        for c in (a for a in toks if re.match(r'^(configs/|\w+::).*\.py$', a)):
            msg = check_config(c)
            if msg:
                problems.append(f'{page}:{line}: `{cmd}`: {msg}')
    assert not problems, '\n'.join(problems)


@pytest.mark.parametrize('page,line,synopsis,block', BLOCKS, ids=[f'{p}:{n}' for p, n, _, _ in BLOCKS])
def test_commands_of_the_docs_run(page, line, synopsis, block):
    env = {}
    problems = []
    for cmd in split_commands(block, synopsis):
        for p in check_command(cmd, synopsis, env):
            problems.append(f'{" ".join(cmd)[:120]}: {p}')
    assert not problems, f'{page}:{line}:\n' + '\n'.join(problems)


def test_command_checker_catches_what_it_should():
    """The checker itself: a missing script, an option the parser does not know, a wrong number of positionals,
    a config that does not exist, a library tool at a path that does not exist."""
    env = {}
    assert check_command(['python', 'tools/train.py', 'configs/demo/mask_rcnn_hvit3_t_demo.py'], False, env) == []
    assert check_command(['python', 'mmdet/tools/train.py', 'x.py'], False, env)
    assert check_command(['python', 'tools/train.py', 'configs/demo/mask_rcnn_hvit3_t_demo.py', '--nope'],
                         False, env)
    assert check_command(['python', 'tools/test.py', 'configs/demo/mask_rcnn_hvit3_t_demo.py'], False, env)
    assert check_command(['python', 'tools/train.py', 'configs/mmdet/no_such_config.py'], False, env)
    assert check_command(['python', 'tools/train.py', 'CONFIG', '--nope'], True, env)
    assert not check_command(['python', 'tools/train.py', 'CONFIG', '[--amp]', '[--cfg-options', 'k=v', '...]'],
                             True, env)
    assert check_command(['mim', 'run', 'mmseg', 'browse_dataset', 'x.py'], False, env)  # two scripts of that name
    assert check_command(['pip', 'install', '-e', '.[nosuchextra]'], False, env)
    assert check_command(['mim', 'train', 'mmnosuchlib', 'configs/demo/mask_rcnn_hvit3_t_demo.py'], False, env)
    assert not check_command(['mim', 'train', 'mmplugin_l2', 'configs/demo/mask_rcnn_hvit3_t_demo.py', '--gpus', '2',
                              '--launcher', 'pytorch', '--work-dir', 'w'], False, env)
