"""What a worker can be asked to do: the tasks it registers, and the routes that need each.

A worker's registry record lists its tasks (engine_worker/registration.py); admission grants
a request only a slot of a worker serving its task (gateway/admission/scripts.py), and a
model none of whose live workers serves the task is a 400 naming it.

    generate   chat and text completions, Responses     (``/internal/generate``)
    embed      ``/v1/embeddings``                         (``/internal/pool``)
    score      ``/v1/score``, ``/v1/rerank``               (``/internal/pool``)
    tokenize   ``/tokenize``, ``/detokenize``            (``/internal/pool``)

A worker's ``--task`` says what its engine runs: ``generate`` (a generative model, which
also tokenizes) or ``embed`` (a pooling model: embeddings, scores as the cosine similarity
of embeddings as vLLM scores with an embedding model, and tokenizing).
"""

from __future__ import annotations

from typing import Literal

Task = Literal["generate", "embed", "score", "tokenize"]
WorkerTask = Literal["generate", "embed"]

GENERATE: Task = "generate"
EMBED: Task = "embed"
SCORE: Task = "score"
TOKENIZE: Task = "tokenize"

#: What a worker started with ``--task`` registers.
SERVED: dict[str, tuple[Task, ...]] = {
    "generate": (GENERATE, TOKENIZE),
    "embed": (EMBED, SCORE, TOKENIZE),
}

#: How an error names the task to the client: the route that needs it.
ROUTES: dict[str, str] = {
    GENERATE: "text generation (chat/completions, completions, responses)",
    EMBED: "embeddings (/v1/embeddings)",
    SCORE: "scoring (/v1/score, /v1/rerank)",
    TOKENIZE: "tokenizing (/tokenize, /detokenize)",
}
