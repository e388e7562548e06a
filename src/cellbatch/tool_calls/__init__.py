"""Tool calls (function calling): the tools a request offers, the formats models write
calls in, reading calls out of an answer as it streams, and offering tools to a chat
template (docs/design.md#tool-calls). Import from the submodules: `calls` < `formats`
< `stream`, `prompt`."""
