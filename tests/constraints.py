"""Constraints for the sampling hook (``SamplingParams.allowed_tokens``) with no grammar library, shared
by the sampling, engine, structured-output and server tests (tests/ is on sys.path)."""

import torch


class RuleMatcher:
    """Allows the ids with (id + sum of the tokens so far) % modulus == 0: a mask that depends on the
    whole history, so a matcher told a token twice, or not at all, allows the wrong ones."""

    def __init__(self, vocab: int, modulus: int):
        self.vocab, self.modulus, self.accepted = vocab, modulus, []

    def allowed(self) -> torch.Tensor:
        return (torch.arange(self.vocab) + sum(self.accepted)) % self.modulus == 0

    def accept(self, token_id: int) -> None:
        assert self.allowed()[token_id], f"token {token_id} was not allowed after {self.accepted}"
        self.accepted.append(token_id)


class Rule:
    """A constraint of :class:`RuleMatcher`s; keeps each matcher it made, for the test to inspect."""

    def __init__(self, vocab: int = 64, modulus: int = 5):
        self.vocab, self.modulus, self.matchers = vocab, modulus, []

    def matcher(self) -> RuleMatcher:
        self.matchers.append(RuleMatcher(self.vocab, self.modulus))
        return self.matchers[-1]


class FailsAfter:
    """A constraint whose matcher raises in ``allowed()`` (or ``accept()``) once it has taken
    ``after`` tokens: what a grammar that exhausts its budget mid-stream does."""

    def __init__(self, after: int, vocab: int, where: str = "allowed", error=RuntimeError):
        self.after, self.vocab, self.where, self.error = after, vocab, where, error
        self.matchers = []

    def matcher(self):
        outer = self

        class Matcher:
            taken = 0

            def allowed(self):
                if outer.where == "allowed" and self.taken >= outer.after:
                    raise outer.error("lexer fuel exhausted")
                return torch.ones(outer.vocab, dtype=torch.bool)

            def accept(self, token_id):
                if outer.where == "accept" and self.taken >= outer.after:
                    raise outer.error("token not allowed: lexer fuel exhausted")
                self.taken += 1

        self.matchers.append(Matcher())
        return self.matchers[-1]
