"""The agent loop: retrieve, prompt, generate under the tool grammar, run tools, repeat.

One run is a sequence of steps. The first retrieval uses the question; the model then
answers, or calls tools (``search_documents`` searches again and its passages become
citable as the next ``[Pn]``). Calls are written in the model's own format where its chat
template has one (``tools/formats.py``: Qwen's ``<tool_call>`` blocks, several per turn,
results as ``tool`` messages), else as a bare JSON object. The output is generated under
the tool-choice grammar, so it is either valid calls to offered tools or plain text; plain
text is the final answer. A call identical to an earlier one of the run is not executed
again, nor written into the conversation (small models given a result tend to make the
same call once more, often where a second, different one was wanted). The step is first
generated again with one token changed where the model was least sure
(``agent/repeat_deviation.py``): a new call whose values are all written in the question,
the calls or their results runs. Else the model is asked again from where it stood, with
the earlier result above it, and may then only answer. The last allowed step, and a step after a repeat,
show no tools and admit only text (the text branch of the tool grammar): with the tools in
view, held-to-text steps wrote calls as text. Once tools have run they end with a user turn
asking for the answer (``agent/prompt.py``: ``ANSWER_REQUEST``), so a run always ends with
an answer and never with call syntax. Such a step re-prefills from the system prompt (the
tools block is gone), a few hundred tokens.

Before the first step the irrelevance gate (``agent/tool_gate.py``) may hold the run to a
text answer with no tools in view, when no offered tool is close to the question or the
model would hardly open a call. After tool results, a text answer that uses none of them
(``agent/call_rules.py``: ``uses_results``) is set aside, unstreamed, and asked for again,
text only.

With ``abstain_threshold`` set, an answerability probe runs first (``agent/answerability.py``)
and a run it judges unanswerable replies ``ABSTENTION`` without generating. With
``citations="attribute"`` the final answer's ``[Pn]`` markers are chosen again, post hoc,
by ``agent/attribution.py``; the generated text is kept in the result's ``attribution``.

Every retrieved passage of the run goes to the prompt-lookup drafter as a source of its
own, the ones that did not fit in the prompt too. The stream of events is the API's shape:
``token`` (answer text as it is decoded), ``tool_call``, ``tool_result``, ``final`` (the
whole result) and ``error``. A run leaves one trace (``agent/trace.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from specrag.agent.answerability import ABSTENTION, AnswerTokens
from specrag.agent.attribution import Attributor
from specrag.agent.call_rules import (
    canonical_call,
    default_tools,
    first_time,
    grounded,
    grounding_sources,
    made_before,
    uses_results,
)
from specrag.agent.events import AgentEvent, ErrorEvent, FinalEvent, TokenEvent, ToolCallEvent, ToolResultEvent
from specrag.agent.loop_checks import AnswerChecks
from specrag.agent.loop_probes import FirstStepProbes
from specrag.agent.prompt import PromptParts, passage_label, prompt_ids
from specrag.agent.repeat_deviation import TRIES, BanAt, MarginRecorder, deviations
from specrag.agent.results import ShownPassage, record_chat, step_record, tool_result_dict
from specrag.agent.run_state import RunOptions, RunState
from specrag.agent.stream import IncrementalDecoder
from specrag.agent.tool_gate import ToolRelevance
from specrag.agent.trace import Tracer
from specrag.decoding.grammar import Grammar
from specrag.decoding.request import GenerationEvent, GenerationRequest
from specrag.decoding.sampling import SamplingParams
from specrag.decoding.stats import GenerationStats
from specrag.retrieval.reflow import lookup_texts
from specrag.tools import (
    ToolCall,
    ToolRegistry,
    ToolResult,
    run_tool_sync,
    search_scope,
)
from specrag.tools.formats import CallFormat, format_for

logger = logging.getLogger(__name__)
Generate = Callable[[GenerationRequest], Iterator[GenerationEvent]]
MAX_DEVIATIONS = 2  # taken per run: a run asked for three values needs two
# The outcome of a deviation the run goes on with. Not "text": the 1.5B's calls after a
# result were often fenced (```json), and its second choice ```python led to a text
# answer that was a call written out (tool-use eval, dev half).
TAKEN = ("ran",)


@dataclass(frozen=True)
class Generated:
    """One generation of a step: its text, and what ``_deviate`` needs to generate it again."""

    text: str
    stats: GenerationStats
    token_ids: list[int]
    prompt_length: int
    recorder: MarginRecorder | None
    grammar: Grammar | None


class AgentLoop(FirstStepProbes, AnswerChecks):
    """Runs the loop over a model's tokenizer, a retriever, tools and a ``generate`` callable."""

    def __init__(
        self,
        tokenizer: Any,
        generate: Generate,
        registry: ToolRegistry,
        grammar_for: Callable[[ToolRegistry, Sequence[str], CallFormat], Any],
        retriever: Any = None,
        *,
        model_name: str = "model",
        system: str | None = None,
        tracer: Tracer | None = None,
        call_format: CallFormat | None = None,
        relevance: ToolRelevance | None = None,
        intent_gate: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.generate = generate
        self.registry = registry
        self.grammar_for = grammar_for
        self.retriever = retriever
        self.model_name = model_name
        self.system = system  # None: chosen by what a step offers (agent/prompt.py)
        self.call_format = call_format or format_for(tokenizer)
        self.tracer = tracer or Tracer()
        self.relevance = relevance  # the gate's relevance signal (None: off)
        self.intent_gate = intent_gate  # the gate's P(call) probe, through ``generate``
        self._answer_tokens: AnswerTokens | None = None
        self._attributor: Attributor | None = None

    def run(self, question: str, options: RunOptions | None = None) -> dict[str, Any]:
        """The whole run; the same structure as ``POST /v1/agent/runs``."""
        final: dict[str, Any] | None = None
        for event in self.events(question, options):
            if isinstance(event, FinalEvent):
                final = event.result
            elif isinstance(event, ErrorEvent):
                raise RuntimeError(event.message) from event.exception
        assert final is not None
        return final

    def events(self, question: str, options: RunOptions | None = None) -> Iterator[AgentEvent]:
        options = options or RunOptions()
        trace = self.tracer.start_trace(attributes={"gen_ai.operation.name": "invoke_agent", "question": question})
        run = RunState(question, options, trace)
        try:
            if self.retriever is not None:
                run.prompt_passages = self._retrieve(run, question, options.lookup_k)
            if run.prompt_passages and (options.abstain_threshold is not None or options.measure_answerability):
                run.answerability = self._probe(run)
            if run.answerability is not None and run.answerability["abstained"]:
                answer = ABSTENTION
                run.steps.append({"index": 0, "kind": "abstain", "answerability": run.answerability})
                yield TokenEvent(0, answer)
            else:
                answer = yield from self._steps(run)
                if options.citations == "attribute" and run.shown and self.retriever is not None:
                    answer = self._attribute(run, answer)
                if options.grounding != "off" and self.retriever is not None and (run.shown or run.executed):
                    answer = self._ground(run, answer)
                if options.grounding == "abstain":  # withheld until checked: sent whole
                    yield TokenEvent(run.steps[-1]["index"] if run.steps else 0, answer)
            result = run.result(answer)
            trace.root.set_attribute("output_tokens", result["usage"]["completion_tokens"])
            trace.finish()
            yield FinalEvent(result)
        except Exception as error:  # reported to the caller as an event; never a stack trace
            logger.exception("agent run %s failed", run.run_id)
            trace.root.record_exception(error)
            trace.finish()
            yield ErrorEvent(error)

    def _steps(self, run: RunState) -> Iterator[AgentEvent] | Any:  # a generator returning the answer
        """Generate, run the tools called, repeat, until the model answers in text."""
        options = run.options
        offered = self._allowed_tools(options) if options.max_steps > 1 else []
        run.tools_offered = bool(offered)
        if offered:
            run.gate = self._gate(run, offered)
        for step in range(options.max_steps):
            last = step == options.max_steps - 1 or run.answer_now or run.held
            # A step that may only answer shows no tools: held to text with the tools in view,
            # both Qwen models wrote calls as text in ever new shapes ({name: "add", ...}).
            tool_names = [] if last else offered
            generated = yield from self._generate_step(run, step, tool_names)
            text, stats = generated.text, generated.stats
            calls = self._parse_calls(text) if tool_names else None
            taken = sum(deviation["outcome"] in TAKEN for deviation in run.deviations)
            if calls and not any(first_time(calls, run.executed)) and taken < MAX_DEVIATIONS:
                deviated = yield from self._deviate(run, step, tool_names, generated)
                if deviated is not None:
                    text, stats = deviated.text, deviated.stats
                    calls = self._parse_calls(text)
            if not calls and tool_names and run.executed and not uses_results(text, run.executed.values()):
                # An answer that ignores every tool result is asked for again, text only.
                run.steps.append({**step_record(step, "answer", stats), "ignored_results": True})
                run.answer_now = True
                continue
            if not calls:
                run.steps.append(step_record(step, "answer", stats))
                if tool_names and run.executed and options.grounding != "abstain":  # held until it used them
                    yield TokenEvent(step, text)
                return text.strip()
            fresh = first_time(calls, run.executed)
            new_calls = [call for call, new in zip(calls, fresh, strict=True) if new]
            if not new_calls:
                run.answer_now = True  # every call was made before: ask again, text only
            elif len(new_calls) < len(calls):  # the conversation keeps only the calls that ran
                text = self.call_format.syntax.separator.join(map(self.call_format.render_call, new_calls))
            if new_calls:
                run.messages.append(self.call_format.assistant_message(text, new_calls))
            for call, new in zip(calls, fresh, strict=True):
                yield ToolCallEvent(step, call.name, call.arguments)
                result = self._execute_new(run, call) if new else run.executed[canonical_call(call)]
                run.steps.append({**step_record(step, "tool_call", stats, call, result), "repeated": not new})
                yield ToolResultEvent(step, tool_result_dict(result))
        return ""

    # -- stages ------------------------------------------------------------------------

    def _retrieve(self, run: RunState, query: str, count: int) -> list[ShownPassage]:
        """Search, show the top ``k`` (new ones get the next labels), feed all to prompt lookup."""
        with run.trace.span(f"retrieval {getattr(self.retriever, 'name', 'index')}") as span:
            passages, timings = self.retriever.search_with_timings(query, count)
            known = {passage.id: passage for passage in run.shown}
            shown = []
            for passage in passages[: run.options.k]:
                if passage.id not in known:
                    known[passage.id] = ShownPassage(
                        passage_label(len(run.shown)), passage.id, passage.source, passage.text
                    )
                    run.shown.append(known[passage.id])
                shown.append(known[passage.id])
            looked_up = {passage_id for passage_id, _ in run.lookup}
            for passage in passages if self.tokenizer is not None else ():  # None: a remote engine drafts
                if passage.id not in looked_up:
                    for text in lookup_texts(passage.text):
                        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                        run.lookup.append((passage.id, list(ids)))
            span.set_attributes(
                {
                    "embed_ms": timings.embed_s * 1000,
                    "search_ms": (timings.search_s + timings.lexical_s) * 1000,
                    "top_k": run.options.k,
                    "passage_ids": [passage.id for passage in shown],
                }
            )
        return shown

    def _deviate(
        self, run: RunState, step: int, tool_names: list[str], generated: Generated
    ) -> Iterator[AgentEvent] | Any:  # a generator returning Generated or None
        """Every call of the step was made before: generate the step again with the written
        token banned where the model was least sure (``agent/repeat_deviation.py``), up to
        ``TRIES`` positions. The first try that makes a new call (not one made before but
        for the case and spaces of its strings) whose values are grounded is returned;
        None: no try did (the next step answers)."""
        assert generated.recorder is not None  # steps after tool results keep their margins
        sources = grounding_sources(run.question, run.executed)
        found = deviations(generated.recorder, generated.token_ids, generated.grammar, self._spell)
        within = [deviation for deviation in found if deviation.margin <= run.options.max_deviation_margin]
        for deviation in within[:TRIES]:
            ban = BanAt(generated.prompt_length, generated.token_ids[: deviation.position], deviation.banned)
            again = yield from self._generate_step(run, step, tool_names, ban)
            calls = self._parse_calls(again.text)
            fresh = [call for call in calls or [] if not made_before(call, run.executed, loosely=True)]
            outcome = "text" if not calls else "repeat" if not fresh else "ran"
            if outcome == "ran" and not all(grounded(call, sources) for call in fresh):
                outcome = "ungrounded"
            run.deviations.append({"step": step, **asdict(deviation), "outcome": outcome})
            if outcome in TAKEN:  # without its spelling variants of earlier calls, if any
                kept = self.call_format.syntax.separator.join(map(self.call_format.render_call, fresh))
                return again if len(fresh) == len(calls or []) else replace(again, text=kept)
        return None

    def _generate_step(
        self, run: RunState, step: int, tool_names: list[str], ban: BanAt | None = None
    ) -> Iterator[AgentEvent] | Any:  # a generator returning Generated
        """One generation: ``tool_names`` may be called and are shown; none: a text answer."""
        with run.trace.span("prompt_build") as span:
            parts = replace(self._parts(run, tool_names), answer_request=bool(run.executed) and not tool_names)
            prompt = prompt_ids(self.tokenizer, parts)
            span.set_attribute("prompt_tokens", len(prompt))
            # Compiled here (cached after the first time): part of building the request. A run
            # that offers tools answers under the text branch of the tool grammar.
            grammar = self.grammar_for(self.registry, tool_names, self.call_format) if run.tools_offered else None
        options = run.options
        # After tool results a step may repeat a call: keep its margins for ``_deviate``.
        recorder = MarginRecorder(len(prompt)) if tool_names and run.executed else None
        processors = [processor for processor in (ban, recorder) if processor is not None]
        request = GenerationRequest(
            prompt,
            max_tokens=options.max_tokens,
            sampling=SamplingParams(temperature=options.temperature, top_p=options.top_p, seed=options.seed),
            speculation=options.speculation,  # type: ignore[arg-type]
            lookup_sources=[ids for _, ids in run.lookup],
            lookup_source_names=[passage_id for passage_id, _ in run.lookup],
            grammar=grammar,
            logits_processors=processors,
            tenant=options.tenant,
        )
        decoder = IncrementalDecoder(self.tokenizer)
        # With tools, text is streamed once it is known not to be a call; after tool results,
        # only once it is known to use them (``_steps`` sends it whole).
        # With grounding="abstain", not before it is checked (``events``).
        withheld = run.options.grounding == "abstain"
        streaming = not tool_names and not withheld
        hold = (bool(tool_names) and bool(run.executed)) or withheld
        call_opening = (self.call_format.syntax.open or "{")[0]
        with run.trace.span(f"chat {self.model_name}", {"gen_ai.request.model": self.model_name}) as chat:
            cycles = []
            stats: GenerationStats | None = None
            token_ids: list[int] = []
            for event in self.generate(request):
                if event.cycle is not None:
                    cycles.append((event.cycle, len(event.token_ids)))
                token_ids.extend(event.token_ids)
                piece = decoder.push(event.token_ids)
                if not streaming and not hold and decoder.text.strip():
                    streaming = not decoder.text.lstrip().startswith(call_opening)
                    piece = decoder.text if streaming else ""
                if streaming and piece:
                    yield TokenEvent(step, piece)
                stats = event.stats or stats
            assert stats is not None
            record_chat(run.trace, chat, cycles, stats)
        run.stats.append(stats)
        return Generated(decoder.finish(), stats, token_ids, len(prompt), recorder, grammar)

    def _parts(self, run: RunState, tool_names: list[str]) -> PromptParts:
        return PromptParts(
            run.question,
            system=self.system,
            tool_schemas=[self.registry.get(name).openai_schema() for name in tool_names],
            tools_offered=run.tools_offered and not run.held,  # the system prompt speaks of tool results
            # Passages found later by search_documents reach the model in its tool result,
            # not here: re-rendering the first message would break the cached prefix.
            passages=run.prompt_passages,
            steps=run.messages,
            call_format=self.call_format,
        )

    def _execute_new(self, run: RunState, call: ToolCall) -> ToolResult:
        """Run a call the run has not made; its result goes back as a ``tool`` message."""
        result = self._execute(run, call)
        run.executed[canonical_call(call)] = result
        run.messages.append({"role": "tool", "content": result.content})
        return result

    def _execute(self, run: RunState, call: ToolCall) -> ToolResult:
        with run.trace.span(f"execute_tool {call.name}", {"gen_ai.tool.name": call.name}) as span:
            with search_scope(_RunSearcher(self, run) if self.retriever is not None else None):
                result = run_tool_sync(self.registry, call.name, call.arguments)
            span.set_attribute("status", "ok" if result.ok else result.error.type if result.error else "error")
            if result.error is not None:
                span.set_status("error", result.error.message)
        return result

    # -- helpers -----------------------------------------------------------------------

    def _allowed_tools(self, options: RunOptions) -> list[str]:
        names = default_tools(self.registry.names) if options.tools is None else list(options.tools)
        for name in names:
            self.registry.get(name)  # UnknownToolError names it
        return names

    def _spell(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _parse_calls(self, text: str) -> list[ToolCall] | None:
        try:
            return self.call_format.parse(text)
        except ValueError:
            return None  # a call cut short by max_tokens is not a call: it ends as text


@dataclass
class _RunSearcher:
    """``search_documents`` inside a run (``specrag.tools.search_scope``): the run's own retrieval, so
    the passages found get the run's next labels, become citable and feed prompt lookup
    (``lookup_k`` of them, the top ``k`` shown)."""

    loop: AgentLoop
    run: RunState

    def search(self, query: str, k: int) -> list[ShownPassage]:
        return self.loop._retrieve(self.run, query, max(k, self.run.options.lookup_k))[:k]
