"""NestPipe: synchronous, staleness-free training of embedding-heavy recommendation models at scale."""

__version__ = "0.1.0"
