"""The documentation resolves: every relative link in README.md, CHANGELOG.md and docs/*.md points to a file of the
repository (and, for links into a Markdown page, to one of its headings); every `docs/...` path cited in code,
configs, tests and tools exists; nothing cites files outside the repository."""
import glob
import os.path as osp
import re

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
