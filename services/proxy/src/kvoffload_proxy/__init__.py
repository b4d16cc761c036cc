"""kvoffload-proxy: the OpenAI-compatible front door (decode-first layerwise flow, metaserver,
health, balancing). The server arrives with the services issue; until then this package only
reserves its place in the monorepo."""

__version__ = "0.1.0"
