"""API surfaces: one module per client-facing API, translating to and from the chat path
(OpenAI chat/completions wire models, the Responses API)."""
