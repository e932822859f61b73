"""Prompt caching, measured: requests that share a long system prompt, with and without the prefix cache.

Every request is ``system prompt (>= 1000 tokens) + its own question``, in the model's
chat template. Each is run twice, greedy: without a prefix cache (the whole prompt is
prefilled) and with one shared :class:`~minillm.prefix_cache.PrefixCache`. The first
request fills the cache; the next ones find the system prompt there and prefill only
their question::

    request 1   [ system prompt ........................ | q1 ]   prefill all   (cold)
    request 2   [ cached ............................... | q2 ]   prefill q2    (warm)
    request 3   [ cached ............................... | q3 ]   prefill q3

TTFT (time to first token) falls by about prompt / suffix on a compute-bound prefill;
the answers stay the same. :func:`run_prefix_demo` returns the numbers,
:func:`plot_prefix_demo` draws them; ``minillm prefix-demo`` prints the table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from .generate import generate
from .generation_config import generation_config_of
from .prefix_cache import PrefixCache, PrefixCacheStats
from .sampling import SamplingParams

# A plausible long system prompt: a support policy, assembled from sections.
POLICY = {
    "Who you are": [
        "You are Juniper, the customer support assistant of Northwind Outfitters, a retailer of outdoor clothing, "
        "camping equipment and climbing gear that sells online and through forty-two stores.",
        "You answer questions from customers about orders, deliveries, returns, repairs, warranties, "
        "loyalty points, product care and store services.",
        "You are friendly, precise and brief; you never invent facts, prices, dates or order details.",
        "When you do not know something, you say so and explain how the customer can find out.",
    ],
    "Orders": [
        "Customers can change or cancel an order within one hour of placing it, from the Orders page of their "
        "account, as long as the order status is still Received.",
        "After one hour the order is handed to the warehouse and can no longer be changed; the customer may "
        "refuse the parcel or return the items once they arrive.",
        "An order confirmation is sent by email within fifteen minutes; if it does not arrive, the customer "
        "should check the spam folder before contacting support.",
        "Orders paid by bank transfer are held for five working days and are cancelled automatically if the "
        "payment has not arrived by then.",
        "Gift cards, custom-cut rope and personalised items cannot be cancelled once the order is placed.",
    ],
    "Delivery": [
        "Standard delivery takes three to five working days and is free for orders above sixty euros; below "
        "that amount it costs four euros and ninety cents.",
        "Express delivery takes one to two working days and costs nine euros and ninety cents, whatever the "
        "order value; it is not available for bulky items such as tents above four kilograms or kayaks.",
        "Customers can collect orders free of charge in any store two working days after ordering; the store "
        "keeps the parcel for fourteen days and then returns it to the warehouse.",
        "Every shipped parcel has a tracking number, sent by email and shown on the Orders page.",
        "If tracking has not changed for five working days, the customer should contact support, who will open "
        "an investigation with the carrier and send a replacement or a refund after ten working days.",
        "We deliver to the European Union, Norway, Switzerland and the United Kingdom; customs duties outside "
        "the European Union are paid by the customer on delivery.",
    ],
    "Returns": [
        "Customers may return any unused item within sixty days of delivery for a full refund, with its labels "
        "attached and in its original packaging where possible.",
        "Returns are free with the prepaid label from the Returns page, or in any store.",
        "Used items can be returned only under the warranty or the satisfaction guarantee described below.",
        "Refunds go back to the original payment method within five working days of the return being checked "
        "at the warehouse; store returns are refunded at once.",
        "Items bought on sale can be returned on the same terms; the refund is the price actually paid.",
        "Gift card balances, hygiene items such as socks and underwear once opened, and custom-cut rope cannot "
        "be returned.",
    ],
    "Satisfaction guarantee": [
        "Members of the loyalty programme may return a used item within one year of purchase if it did not "
        "meet their expectations, once per product type.",
        "The guarantee covers normal use; it does not cover damage from accidents, misuse, pets, fire or "
        "modifications, nor wear that is expected after a year of regular use.",
        "Items returned under the guarantee are refunded as a store credit valid for two years.",
    ],
    "Warranty and repairs": [
        "Every product has a two-year legal warranty against manufacturing defects, from the date of delivery.",
        "Northwind's own brand, Greylag, carries a five-year warranty on jackets, backpacks and tents.",
        "A warranty claim needs the order number or receipt and photos of the defect; support replies within "
        "three working days.",
        "Defective items are repaired when possible, otherwise replaced with the same or an equivalent product, "
        "otherwise refunded.",
        "Our repair workshop also fixes items outside the warranty for a fee: zips from fifteen euros, seams from "
        "ten euros, tent poles from twenty euros; quotes are free and repairs take about three weeks.",
        "Climbing harnesses, ropes, helmets and carabiners are safety equipment: they are never repaired, and a "
        "defective one is always replaced or refunded.",
    ],
    "Loyalty programme": [
        "Membership is free. Members earn one point per euro spent, online and in stores, and points are added "
        "when the return period of the order has ended.",
        "One hundred points are worth a five euro voucher; vouchers are valid for one year and can be combined "
        "with sale prices but not with other vouchers.",
        "Points expire after twenty-four months without any purchase.",
        "Members get early access to seasonal sales and free rental of the demo equipment in stores.",
    ],
    "Product care": [
        "Waterproof jackets should be washed at thirty degrees with a technical detergent, without softener, "
        "and tumble dried on low heat to restore the water-repellent finish.",
        "Down jackets and sleeping bags are washed on a gentle cycle with down detergent and dried with two or "
        "three tennis balls, which breaks up clumps of down.",
        "Tents must be completely dry before being stored; storing a damp tent causes mould that the warranty "
        "does not cover.",
        "Leather boots need cleaning and waxing every few outings; never dry them next to a heater.",
    ],
    "Privacy and security": [
        "Never ask for or repeat full card numbers, passwords or security codes.",
        "To discuss an order, ask for the order number and the email address used; never reveal the address, "
        "phone number or payment details stored on an account.",
        "Customers can download or delete their personal data from the Privacy page of their account.",
    ],
    "Escalation": [
        "Hand the conversation to a human agent when the customer asks for one, when a safety issue is reported, "
        "when a refund above three hundred euros is requested, or when the customer is upset after two replies.",
        "Human agents are available from eight in the morning to eight in the evening, Monday to Saturday; outside "
        "these hours, tell the customer when they can expect an answer.",
    ],
    "Style": [
        "Answer in the language of the customer.",
        "Start with the answer itself, then give the steps or conditions that apply, in at most five short "
        "sentences.",
        "Do not use marketing language and do not recommend products unless the customer asks for a "
        "recommendation.",
        "End by asking whether there is anything else you can help with.",
    ],
}

QUESTIONS = [
    "I ordered a tent yesterday evening. Can I still cancel the order?",
    "How long does express delivery take, and how much does it cost?",
    "My rain jacket is leaking after one year. What can I do?",
    "How many loyalty points do I need for a five euro voucher?",
    "Can I return hiking socks that I have already worn once?",
    "How should I wash my down sleeping bag?",
    "My parcel tracking has not changed for a week. What happens now?",
    "Do you repair broken tent poles, and what does it cost?",
]


def system_prompt() -> str:
    """The shared system prompt: the policy, as a markdown-like document."""
    return "\n\n".join(f"## {title}\n" + "\n".join(f"- {s}" for s in sentences) for title, sentences in POLICY.items())


def question(i: int) -> str:
    """The i-th request's question (cycled, numbered past the list so every prompt differs)."""
    q = QUESTIONS[i % len(QUESTIONS)]
    return q if i < len(QUESTIONS) else f"{q} (ticket {i + 1})"


def build_prompts(tokenizer, n_requests: int, system: str | None = None) -> list[list[int]]:
    """Token ids of each request: the chat template over (system prompt, question i)."""
    system = system_prompt() if system is None else system
    prompts = []
    for i in range(n_requests):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question(i)}]
        if tokenizer.has_chat_template:
            prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(f"{system}\n\nQuestion: {question(i)}\nAnswer:"))
    return prompts


@dataclass(frozen=True)
class DemoRow:
    """One request, run without and with the prefix cache.

    Attributes:
        request: 1-based index. question: its question.
        prompt_tokens, cached_tokens, prefill_tokens: tokens (cached + prefill = prompt).
        ttft_no_cache_ms, ttft_cache_ms: time to first token (ms), request start to first token known.
        kv_bytes_saved: K/V bytes the prefill did not recompute (cached_tokens · KV bytes per token).
        hit_rate: the cache's hit rate (hit tokens / query tokens) after this request.
        same_output: the greedy tokens with the cache equal those without.
    """

    request: int
    question: str
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    ttft_no_cache_ms: float
    ttft_cache_ms: float
    kv_bytes_saved: int
    hit_rate: float
    same_output: bool

    @property
    def speedup(self) -> float:
        """TTFT without the cache / TTFT with it."""
        return self.ttft_no_cache_ms / self.ttft_cache_ms


@dataclass(frozen=True)
class PrefixDemoResult:
    """All rows, plus what they share and the cache's final stats."""

    rows: list[DemoRow]
    shared_prefix_tokens: int
    block_size: int
    max_new_tokens: int
    stats: PrefixCacheStats

    @property
    def warm_rows(self) -> list[DemoRow]:
        """The requests that found a cached prefix."""
        return [r for r in self.rows if r.cached_tokens > 0]

    @property
    def warm_speedup(self) -> float:
        """Total TTFT without / with the cache, over the warm requests (nan if none)."""
        warm = self.warm_rows
        if not warm:
            return float("nan")
        return sum(r.ttft_no_cache_ms for r in warm) / sum(r.ttft_cache_ms for r in warm)


def run_prefix_demo(model, tokenizer, n_requests: int = 4, block_size: int = 16, max_new_tokens: int = 8,
                    system: str | None = None, progress: bool = False) -> PrefixDemoResult:
    """Run ``n_requests`` shared-system-prompt requests without and with a prefix cache; return the numbers.

    Each request runs first without the cache, then with it (interleaved, so a machine
    getting slower or faster affects both alike), after one warm-up generate.
    ``progress``: a progress bar over the requests on stderr (drawn only when stderr is a
    terminal, and erased at the end).
    Raises ValueError for n_requests < 1.
    """
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    prompts = build_prompts(tokenizer, n_requests, system)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    eos = set(tokenizer.eos_token_ids) | set(generation_config_of(model).eos_token_ids)
    pc = PrefixCache(model, block_size=block_size)
    kv_per_token = model.config.kv_bytes_per_token(next(model.parameters()).element_size())
    _timed(model, prompts[0][:32], params, eos, None)  # warm-up: first-call overheads out of request 1
    rows = []
    console = Console(stderr=True)  # off on a pipe: rich would still end its bar with a blank line there
    with Progress(console=console, disable=not (progress and console.is_terminal), transient=True) as bar:
        for i, prompt in enumerate(bar.track(prompts, description="requests without and with the prefix cache")):
            ttft_off, out_off, _ = _timed(model, prompt, params, eos, None)
            ttft_on, out_on, cached = _timed(model, prompt, params, eos, pc)
            rows.append(DemoRow(i + 1, question(i), len(prompt), cached, len(prompt) - cached, ttft_off, ttft_on,
                                cached * kv_per_token, pc.stats.hit_rate, out_on == out_off))
    return PrefixDemoResult(rows, _common_prefix(prompts), block_size, max_new_tokens, pc.stats)


def _timed(model, prompt, params, eos, prefix_cache) -> tuple[float, list[int], int]:
    """(TTFT ms, output tokens, cached tokens) of one greedy request."""
    start = time.perf_counter()
    steps = list(generate(model, prompt, params, eos_token_ids=eos, prefix_cache=prefix_cache))
    return (steps[0].time_s - start) * 1e3, [s.token_id for s in steps], steps[0].cached_tokens


def _common_prefix(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n for p in prompts) and len({p[n] for p in prompts}) == 1:
        n += 1
    return n


def plot_prefix_demo(result: PrefixDemoResult, path: str | Path) -> Path:
    """Bar chart of TTFT per request, without and with the prefix cache, into a PNG; returns the path."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    rows = result.rows
    x = range(len(rows))
    fig = Figure(figsize=(1.6 * len(rows) + 3, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar([i - 0.2 for i in x], [r.ttft_no_cache_ms for r in rows], 0.4, label="no prefix cache", color="#999")
    bars = ax.bar([i + 0.2 for i in x], [r.ttft_cache_ms for r in rows], 0.4, label="prefix cache", color="#2a7")
    for bar, r in zip(bars, rows):
        top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        ax.annotate(f"{r.cached_tokens} cached\n×{r.speedup:.1f}", top, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"request {r.request}\n{r.prompt_tokens} tok" for r in rows])
    ax.set_ylabel("TTFT (ms)")
    speedup = "n/a (one request)" if not result.warm_rows else f"×{result.warm_speedup:.1f}"  # no warm request to time
    ax.set_title(f"Prefix cache: {result.shared_prefix_tokens} shared prompt tokens, block_size {result.block_size}\n"
                 f"warm TTFT speedup {speedup}, hit rate {100 * result.stats.hit_rate:.0f}%",
                 fontsize=10)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
