"""An embeddings upstream for the semantic cache's tests and benchmark: a bag of words,
stop words left out, each word hashed to a dimension, normalised. Deterministic: a
paraphrase with the same content words lands on the same vector (similarity 1), one that
adds a word lands near (2 of 3 words shared: 0.82), another question lands far."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
from dataclasses import dataclass

from aiohttp import web

DIM = 256
STOP_WORDS = ("a an the is are was of to in on for me please tell what whats what's do does "
              "can you i my your how which who and or it this that be")
STOP = frozenset(STOP_WORDS.split())
SYNONYMS = {"nation": "country", "nations": "country", "countries": "country",
            "city": "city", "biggest": "largest", "capitol": "capital"}


def words(text: str) -> list[str]:
    found = re.findall(r"[a-z0-9']+", text.lower())
    return [SYNONYMS.get(w, w) for w in found if w not in STOP]


def embed(text: str, dim: int = DIM) -> list[float]:
    vector = [0.0] * dim
    for word in words(text):
        vector[int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % dim] += 1
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


@dataclass
class EmbeddingFake:
    status: int = 200
    calls: int = 0
    hold_s: float = 0.0  # time before answering

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        await asyncio.sleep(self.hold_s)
        if self.status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.status)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return web.json_response({
            "object": "list", "model": body["model"],
            "data": [{"object": "embedding", "index": i, "embedding": embed(text)}
                     for i, text in enumerate(inputs)],
            "usage": {"prompt_tokens": 4, "total_tokens": 4}})
