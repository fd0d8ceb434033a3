"""What the docs site knows about the repository: seed sections, pages, sources and tests.

Contract
--------
- ``SEED_SECTIONS`` is the list of the five source documents' sections that tinyvllm follows,
  each with the docs page that explains it and the tutorial that replays it (if any).
- A test says which section it pins down with the pytest marker ``seed``::

      @pytest.mark.seed("002:3.2")
      def test_prefix_caching_seed002_walkthrough_steps_0_to_6(): ...

  or, for a whole file, ``pytestmark = pytest.mark.seed("001:N")``. ``scan_tests`` reads the
  markers straight from the test files' syntax trees (nothing is imported, nothing runs), so
  the matrix and status tables built here always describe the suite as it is.
- A section with nothing to build of its own carries ``prose_only``, the reason no test
  marks it; its status row gives the reason instead of "not yet".
- ``PAGE_SOURCES`` maps each walkthrough page to the source files it explains; the site links
  them under the page's title.
- Pure functions only: the mkdocs hook (``site_pages.py``) and the tests
  (``tests/test_docs_catalog.py``) both call them. No mkdocs import here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_DIRS = ("tests", "property_tests")
# Folders whose files get a page of their own on the site (the "code" section).
CODE_DIRS = ("src/tinyvllm", "tests", "property_tests", "tutorials", "bench")
CODE_PREFIX = "code"  # the generated pages live under docs/code/<path>.md


@dataclass(frozen=True)
class Seed:
    number: str
    title: str
    link: str | None


SEEDS = {
    "000": Seed("000", 'vLLM design doc "CUDA Graphs" (read in a Chinese translation)',
                "https://docs.vllm.ai/en/latest/design/cuda_graphs.html"),
    "001": Seed("001", '"vLLM V1 Sample, Part 2: logits processors and thinking budget" (Chinese)', None),
    "002": Seed("002", '"vLLM V1: KVCacheManager and prefix caching" (Chinese)', None),
    "003": Seed("003", '"vLLM V1 part 4: KV cache management" (Chinese)', None),
    "004": Seed("004", 'vLLM PR #9668 "[V1] Prefix caching"', "https://github.com/vllm-project/vllm/pull/9668"),
}  # fmt: skip


@dataclass(frozen=True)
class SeedSection:
    key: str  # "<seed>:<section>", the marker's argument
    section: str  # how the docs cite it
    topic: str  # what it is about, in English
    page: str  # the walkthrough page (docs-relative)
    tutorial: str | None = None  # tutorials/<stem>.py that replays it
    # Why no test marks it, for a section with nothing of its own to build (a summary of
    # other sections, a figure lost from the document, a feature tinyvllm has no use for).
    # Such a section is explained on its page, and its status row says this instead of
    # "not yet"; a test fails if a test is ever marked with it (the reason would be stale).
    prose_only: str | None = None

    @property
    def seed(self) -> str:
        return self.key.split(":", 1)[0]


S = SeedSection
SEED_SECTIONS: tuple[SeedSection, ...] = (
    S("000:motivation", "动机", "why the design: graph capture tied to compilation, all or nothing; four design goals", "cuda_graphs.md", "07_cuda_graphs"),
    S("000:modes", "CudagraphModes", "CUDAGraphMode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE", "cuda_graphs.md"),
    S("000:overview", "概述", "the design before and after: graph logic out of compilation, dispatch made explicit", "cuda_graphs.md",
      prose_only="a summary of the sections after it, whose tests pin what it summarises (its two figures are lost)"),
    S("000:descriptor", "BatchDescriptor", "the key a graph is captured and replayed under", "cuda_graphs.md"),
    S("000:dispatcher", "CudagraphDispatcher", "keys, padding, dispatch FULL > PIECEWISE > NONE", "cuda_graphs.md", "07_cuda_graphs"),
    S("000:wrapper", "CUDAGraphWrapper", "capture, replay and pass-through; the forward context", "cuda_graphs_wrapper.md", "07_cuda_graphs"),
    S("000:nested", "嵌套 Wrapper 设计", "the nested design: piecewise pieces inside a full wrapper", "cuda_graphs_wrapper.md"),
    S("000:capture", "完整 CUDA 图捕获 & 热身", "warm-up and capture at start-up; persistent buffers", "cuda_graphs_capture.md"),
    S("000:cgsupport", "Attention 后端对 CUDA 图的兼容性", "AttentionCGSupport and the mode downgrades", "cuda_graphs_backends.md"),
    S("000:usage", "使用指南", "compilation_config, enforce_eager and the CLI flags", "cuda_graphs_backends.md"),
    S("000:passes", "分段编译和完整图自定义通道", "compiler passes that need the whole graph, against piecewise compilation", "cuda_graphs_wrapper.md",
      prose_only="not built: tinyvllm compiles nothing, so it has no such passes; its split at attention is written into the model"),
    S("000:performance", "关于性能", "performance (the document's links are lost); the decode-step benchmark bench/cudagraphs.py", "cuda_graphs_backends.md"),
    S("001:7", "ch. 7", "LogitsProcessor interface, MoveDirectionality, BatchUpdate", "persistent_batch.md", "03_logits_processors"),
    S("001:7.5", "ch. 7.5", "the type aliases RemovedRequest, AddedRequest, MovedRequest", "persistent_batch.md"),
    S("001:8", "ch. 8", "BatchUpdateBuilder: descending removed list, pop the lowest hole, get_and_reset", "persistent_batch.md", "03_logits_processors"),
    S("001:9", "ch. 9", "the LogitsProcessors container and the argmax-invariant split", "logits_processors.md"),
    S("001:10", "ch. 10", "MinP, LogitBias, MinTokens and process_dict_updates", "logits_processors.md", "03_logits_processors"),
    S("001:11", "ch. 11", "plugin loading: entry points, FQCNs, build_logitsprocs", "logits_processor_plugins.md"),
    S("001:12", "ch. 12", "AdapterLogitsProcessor: per-request callables as a batch processor", "logits_processor_plugins.md"),
    S("001:13", "ch. 13", "ThinkingBudgetStateHolder: counting think tokens and forcing the end", "thinking_budget.md", "04_thinking_budget"),
    S("001:C", "appendix C", "the logits processors' lifecycle as a sequence diagram", "persistent_batch.md",
      prose_only="the document's diagram is lost (a title only); the page draws one step's lifecycle, pinned under ch. 7, ch. 8 and appendix U2"),
    S("001:D", "appendix D", "the thinking-budget state machine and force_index's three cases", "thinking_budget.md", "04_thinking_budget"),
    S("001:N", "appendix N", "process_dict_updates in five scenarios", "logits_processors.md", "03_logits_processors"),
    S("001:O", "appendix O", "thinking-budget state fields and the force_index formula", "thinking_budget.md", "04_thinking_budget"),
    S("001:P", "appendix P", "the adapter in depth: signature detection, output ids by reference", "logits_processor_plugins.md"),
    S("001:Q", "appendix Q", "build_logitsprocs' decision tree and plugin cache", "logits_processor_plugins.md"),
    S("001:R2", "appendix R2", "MinP's state update walked through (the active count)", "logits_processors.md", "03_logits_processors"),
    S("001:S2", "appendix S2", "LogitBias: from the dict to index tensors", "logits_processors.md", "03_logits_processors"),
    S("001:T2", "appendix T2", "_apply_forcing_to_logits line by line", "thinking_budget.md", "04_thinking_budget"),
    S("001:U2", "appendix U2", "BatchUpdateBuilder and the input batch: holes filled lowest first", "persistent_batch.md", "03_logits_processors"),
    S("002:opening", "opening", "token-budget scheduling, waiting and running queues, preemption", "scheduler.md", "02_scheduler"),
    S("002:1.1", "§1.1", "prefix caching on full blocks only, and only prefixes", "prefix_hashing.md"),
    S("002:1.2", "§1.2", "block hash = (parent hash, block tokens, extra keys)", "prefix_hashing.md"),
    S("002:2.1", "§2.1", "KVCacheBlock", "free_queue.md"),
    S("002:2.2", "§2.2", "FreeKVCacheBlockQueue: doubly linked LRU list, reverse-order append", "free_queue.md", "01_prefix_caching"),
    S("002:2.3", "§2.3", "cached_block_hash_to_block", "block_pool.md"),
    S("002:2.4", "§2.4", "BlockPool", "block_pool.md"),
    S("002:2.5", "§2.5", "KVCacheManager", "kv_cache_manager.md"),
    S("002:3.1", "§3.1", "computed, new computed and new blocks for waiting and running requests", "kv_cache_manager.md", "01_prefix_caching"),
    S("002:3.2", "§3.2", "the worked example: block size 4, ten blocks, steps 0-6", "kv_cache_manager.md", "01_prefix_caching"),
    S("003:hash", "KV block hash", "hash_request_tokens", "prefix_hashing.md"),
    S("003:blocks", "KV block管理", "KVCacheBlock and KVCacheManager fields, preallocation", "kv_cache_manager.md"),
    S("003:free_queue", "FreeKVCacheBlockQueue详细介绍", "popleft, remove, append", "free_queue.md"),
    S("003:allocate", "KV cache block分配", "get_computed_blocks and allocate_slots step by step", "kv_cache_manager.md", "01_prefix_caching"),
    S("003:free", "KV cache block释放", "free in reverse order", "kv_cache_manager.md"),
    S("003:memory", "KV cache物理内存分配", "one tensor per layer, KV sizing, slot mapping, attention metadata", "kv_cache_memory.md", "05_paged_attention"),
    S("004:data", "Data Structure", "block pool, free block queue, cached block map", "block_pool.md"),
    S("004:algorithms", "Algorithms: Allocate Slots, Append Slots, Free", "allocation, appending and freeing", "kv_cache_manager.md"),
    S("004:computed", "Get Computed Blocks", "the longest cached prefix of full blocks", "kv_cache_manager.md"),
    S("004:duplication", "Duplication", "append-only block tables and duplicate blocks", "block_pool.md"),
    S("004:corner", "review: evictable computed blocks", "hits in the free queue are not free blocks", "kv_cache_manager.md"),
    S("004:benchmark", "Benchmark", "throughput and TTFT with prefix caching on a GPU", "kv_cache_manager.md"),
)  # fmt: skip
SECTION_BY_KEY = {s.key: s for s in SEED_SECTIONS}

# Each walkthrough page and the source files it explains (linked under the page's title).
PAGE_SOURCES: dict[str, tuple[str, ...]] = {
    "prefix_hashing.md": ("src/tinyvllm/core/prefix_hash.py",),
    "free_queue.md": ("src/tinyvllm/core/free_queue.py",),
    "block_pool.md": ("src/tinyvllm/core/block_pool.py",),
    "kv_cache_manager.md": ("src/tinyvllm/core/kv_cache_manager.py",),
    "scheduler.md": ("src/tinyvllm/core/scheduler.py", "src/tinyvllm/core/sched_output.py", "src/tinyvllm/request.py"),
    "persistent_batch.md": ("src/tinyvllm/sample/batch_update.py", "src/tinyvllm/worker/input_batch.py"),
    "logits_processors.md": (
        "src/tinyvllm/sample/logits_processors/interface.py",
        "src/tinyvllm/sample/logits_processors/state.py",
        "src/tinyvllm/sample/logits_processors/builtin.py",
    ),
    "logits_processor_plugins.md": (
        "src/tinyvllm/sample/logits_processors/loader.py",
        "src/tinyvllm/sample/logits_processors/adapter.py",
    ),
    "thinking_budget.md": ("src/tinyvllm/sample/thinking_budget.py",),
    "sampler.md": ("src/tinyvllm/sample/sampler.py", "src/tinyvllm/sample/metadata.py"),
    "sampler_draw.md": (
        "src/tinyvllm/sample/sampler.py",
        "src/tinyvllm/sample/top_k_top_p.py",
        "src/tinyvllm/sample/ops/random_sample.py",
        "src/tinyvllm/sample/draw_keys.py",
    ),
    "sampler_penalties.md": ("src/tinyvllm/sample/penalties.py", "src/tinyvllm/sample/bad_words.py"),
    "sampler_logprobs.md": ("src/tinyvllm/sample/logprobs.py", "src/tinyvllm/worker/prompt_logprobs.py"),
    "kv_cache_memory.md": (
        "src/tinyvllm/worker/attention_metadata.py",
        "src/tinyvllm/attention/metadata.py",
        "src/tinyvllm/attention/kv_cache_write.py",
    ),
    "paged_attention.md": (
        "src/tinyvllm/attention/reference.py",
        "src/tinyvllm/attention/torch_sdpa.py",
        "src/tinyvllm/attention/triton_attention.py",
    ),
    "model_runner.md": (
        "src/tinyvllm/worker/model_runner.py",
        "src/tinyvllm/executor/abstract.py",
        "src/tinyvllm/executor/uniproc_executor.py",
        "src/tinyvllm/worker/worker.py",
        "src/tinyvllm/worker/kv_cache.py",
        "src/tinyvllm/models/llama.py",
        "src/tinyvllm/models/loader.py",
        "src/tinyvllm/models/tokenizer.py",
        "src/tinyvllm/models/model_files.py",
    ),
    "cuda_graphs.md": ("src/tinyvllm/worker/cudagraph_dispatcher.py",),
    "cuda_graphs_wrapper.md": ("src/tinyvllm/worker/cuda_graph.py", "src/tinyvllm/models/llama.py"),
    "cuda_graphs_capture.md": (
        "src/tinyvllm/worker/cudagraph_capture.py",
        "src/tinyvllm/worker/model_runner.py",
        "src/tinyvllm/worker/block_table.py",
        "src/tinyvllm/worker/input_buffers.py",
    ),
    "cuda_graphs_backends.md": (
        "src/tinyvllm/attention/cudagraph_support.py",
        "src/tinyvllm/worker/cudagraph_dispatcher.py",
    ),
    "generating_text.md": (
        "src/tinyvllm/engine/llm.py",
        "src/tinyvllm/engine/engine_args.py",
        "src/tinyvllm/models/hub.py",
        "src/tinyvllm/sampling_defaults.py",
        "src/tinyvllm/config.py",
    ),
    "generating_text_generate.md": (
        "src/tinyvllm/engine/llm.py",
        "src/tinyvllm/engine/input_processor.py",
        "src/tinyvllm/engine/llm_engine.py",
        "src/tinyvllm/outputs.py",
        "src/tinyvllm/sampling_params.py",
    ),
    "generating_text_cli.md": ("src/tinyvllm/cli.py", "src/tinyvllm/cpu_threads.py"),
    "failure_and_bad_input.md": ("src/tinyvllm/validation.py", "src/tinyvllm/engine/llm_engine.py"),
    "serving.md": ("src/tinyvllm/engine/output_processor.py", "src/tinyvllm/engine/detokenizer.py"),
    "serving_async.md": (
        "src/tinyvllm/engine/async_llm.py",
        "src/tinyvllm/engine/prompt_tokenizer.py",
        "src/tinyvllm/entrypoints/streams.py",
    ),
    "serving_endpoints.md": (
        "src/tinyvllm/entrypoints/openai_server.py",
        "src/tinyvllm/entrypoints/protocol.py",
        "src/tinyvllm/entrypoints/serving.py",
        "src/tinyvllm/entrypoints/chat.py",
        "src/tinyvllm/entrypoints/choices.py",
        "src/tinyvllm/entrypoints/logprobs_format.py",
        "src/tinyvllm/entrypoints/tokenization.py",
        "src/tinyvllm/entrypoints/metrics.py",
    ),
    "serving_reasoning.md": ("src/tinyvllm/entrypoints/reasoning.py",),
    "serving_embeddings.md": (
        "src/tinyvllm/entrypoints/embeddings.py",
        "src/tinyvllm/entrypoints/scoring.py",
        "src/tinyvllm/engine/scoring.py",
    ),
    "tensor_parallel.md": ("src/tinyvllm/distributed/parallel_state.py", "src/tinyvllm/distributed/utils.py", "src/tinyvllm/models/parallel_layers.py", "src/tinyvllm/executor/multiproc_executor.py"),
}


# ----------------------------------------------------------------------------------------
# The test suite, read from its syntax trees.


@dataclass(frozen=True)
class TestRef:
    name: str  # the function name, or a state machine's TestCase name
    path: str  # repo-relative, e.g. "tests/test_scheduler.py"
    line: int  # its first line: the first decorator, else the ``def`` (or the assignment)
    seeds: tuple[str, ...]  # section keys from its own and its module's ``seed`` markers
    gpu: bool = False  # marked ``gpu``: runs only where CUDA is


def _has_mark(nodes: list[ast.expr], name: str) -> bool:
    """Whether ``pytest.mark.<name>`` appears among the given expressions."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
        for node in nodes
        for n in ast.walk(node)
    )


def _seed_marks(decorators: list[ast.expr]) -> list[str]:
    """Section keys of every ``pytest.mark.seed(...)`` among the given expressions."""
    keys: list[str] = []
    for node in decorators:
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "seed"
                and isinstance(call.func.value, ast.Attribute)
                and call.func.value.attr == "mark"
            ):
                for arg in call.args:
                    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                        raise ValueError(f"pytest.mark.seed takes string literals, got {ast.dump(arg)}")
                    keys.append(arg.value)
    return keys


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Where a reader should land: the first decorator (the marks), else the ``def``."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def scan_test_file(path: Path, repo: Path = REPO) -> list[TestRef]:
    """Every test a file defines, with the seed sections it is marked with."""
    rel = path.relative_to(repo).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    module_keys: list[str] = []
    module_marks: list[ast.expr] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_keys += _seed_marks([node.value])
            module_marks.append(node.value)
    refs: list[TestRef] = []

    def add(name: str, line: int, own: list[str], marks: list[ast.expr] = ()) -> None:
        keys = tuple(dict.fromkeys(module_keys + own))
        refs.append(TestRef(name, rel, line, keys, _has_mark(module_marks + list(marks), "gpu")))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            add(node.name, _first_line(node), _seed_marks(node.decorator_list), node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_keys = _seed_marks(node.decorator_list)
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
            for m in methods:
                add(m.name, _first_line(m), class_keys + _seed_marks(m.decorator_list), node.decorator_list + m.decorator_list)
            if not methods:
                add(node.name, _first_line(node), class_keys, node.decorator_list)
        elif isinstance(node, ast.Assign):  # TestMachine = SomeStateMachine.TestCase
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith("Test"):
                    add(target.id, node.lineno, _seed_marks([node.value]), [node.value])
    return refs


def scan_tests(repo: Path = REPO) -> list[TestRef]:
    """Every test of the suite, in file order."""
    refs: list[TestRef] = []
    for folder in TEST_DIRS:
        for path in sorted((repo / folder).glob("test_*.py")):
            refs += scan_test_file(path, repo)
    return refs


def tests_by_name(refs: list[TestRef]) -> dict[str, list[TestRef]]:
    by_name: dict[str, list[TestRef]] = {}
    for ref in refs:
        by_name.setdefault(ref.name, []).append(ref)
    return by_name


def tests_by_section(refs: list[TestRef]) -> dict[str, list[TestRef]]:
    """Section key -> the tests marked with it (unknown keys included, so callers can report them)."""
    by_key: dict[str, list[TestRef]] = {}
    for ref in refs:
        for key in ref.seeds:
            by_key.setdefault(key, []).append(ref)
    return by_key


def unknown_seed_keys(refs: list[TestRef]) -> list[str]:
    """'path::test uses unknown section key' for every marker naming no registered section."""
    return [f"{r.path}::{r.name} uses seed key {k!r}" for r in refs for k in r.seeds if k not in SECTION_BY_KEY]


# ----------------------------------------------------------------------------------------
# Where things live on the site.


def code_page(path: str) -> str:
    """The docs-relative page of a repository file, e.g. ``code/tests/test_x.py.md``."""
    return f"{CODE_PREFIX}/{path}.md"


def code_files(repo: Path = REPO) -> list[str]:
    """Repo-relative paths of every file that gets a code page."""
    files: list[str] = []
    for folder in CODE_DIRS:
        for path in sorted((repo / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                files.append(path.relative_to(repo).as_posix())
    return files


def line_anchor(line: int) -> str:
    """The anchor pymdownx.highlight gives line ``line`` of a page's first code block."""
    return f"__codelineno-0-{line}"


# ----------------------------------------------------------------------------------------
# The tables.


def section_status(refs: list[TestRef]) -> list[tuple[SeedSection, list[TestRef]]]:
    by_key = tests_by_section(refs)
    return [(s, by_key.get(s.key, [])) for s in SEED_SECTIONS]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _untested(section: SeedSection) -> str:
    """The cell of a section no test marks: its prose-only reason, else "not yet"."""
    return f"explained, no test of its own: {section.prose_only}" if section.prose_only else "not yet"


def render_matrix(refs: list[TestRef], link) -> str:
    """Markdown of the matrix: seed section -> docs page -> test ids -> tutorial.

    ``link(kind, target)`` turns ("page", "x.md"), ("test", TestRef) or ("tutorial", stem)
    into a markdown link; the hook and the README pass different ones.
    """
    lines = []
    for number, seed in SEEDS.items():
        title = f"[{seed.title}]({seed.link})" if seed.link else seed.title
        lines += [f"### Seed {number}: {title}", ""]
        lines += ["| section | what | docs | tests | tutorial |", "|---|---|---|---|---|"]
        for section, tests in section_status(refs):
            if section.seed != number:
                continue
            test_cell = ", ".join(link("test", t) for t in tests) if tests else _untested(section)
            tut = link("tutorial", section.tutorial) if section.tutorial else "not yet"
            lines.append(
                f"| {_cell(section.section)} | {_cell(section.topic)} | {link('page', section.page)} "
                f"| {test_cell} | {tut} |"
            )
        lines.append("")
    return "\n".join(lines)


def render_status(refs: list[TestRef], link) -> str:
    """Markdown of the status table: one row per seed section: built and tested, prose only, or not yet."""
    lines = ["| seed | section | what | status | docs |", "|---|---|---|---|---|"]
    for section, tests in section_status(refs):
        if tests:
            files = sorted({t.path for t in tests})
            gpu = sum(t.gpu for t in tests)
            count = f"{len(tests)} test{'s' if len(tests) != 1 else ''}"
            if gpu == len(tests):
                count += ", on a GPU only" if gpu == 1 else ", all on a GPU only"
            elif gpu:
                count += f", {gpu} of them on a GPU only"
            status = f"built, {count} (" + ", ".join(link("file", f) for f in files) + ")"
        else:
            status = _untested(section)
        lines.append(
            f"| {section.seed} | {_cell(section.section)} | {_cell(section.topic)} | {status} "
            f"| {link('page', section.page)} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# The README's copy of the status table (GitHub shows the README, not the site).

README_START = "<!-- status:start (generated by `python docs_hooks/catalog.py`; a test checks it) -->"
README_END = "<!-- status:end -->"


def site_url(repo: Path = REPO) -> str:
    """``site_url`` from mkdocs.yml (read as text: the file holds tags a YAML loader refuses)."""
    for line in (repo / "mkdocs.yml").read_text(encoding="utf-8").splitlines():
        if line.startswith("site_url:"):
            return line.split(":", 1)[1].strip().rstrip("/") + "/"
    raise ValueError("mkdocs.yml has no site_url")


def site_page_url(page: str, repo: Path = REPO) -> str:
    """The published address of a docs page, e.g. block_pool.md -> <site_url>block_pool/."""
    stem = page[:-3]
    return site_url(repo) + ("" if stem == "index" else stem + "/")


def readme_link(kind: str, target) -> str:
    if kind == "page":
        return f"[{target[:-3]}]({site_page_url(target)})"
    if kind == "file":
        return f"[`{target.rsplit('/', 1)[-1]}`]({target})"
    raise ValueError(kind)


def readme_status_block(refs: list[TestRef]) -> str:
    return f"{README_START}\n{render_status(refs, readme_link)}\n{README_END}"


def update_readme(repo: Path = REPO) -> bool:
    """Rewrite the README's status block; return whether it changed."""
    path = repo / "README.md"
    text = path.read_text(encoding="utf-8")
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    new = text[:start] + readme_status_block(scan_tests(repo)) + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    print("README.md status table " + ("updated" if update_readme() else "already up to date"))
