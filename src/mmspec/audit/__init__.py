"""``mmspec audit``'s library: is an OpenAI-compatible endpoint lossless?

Sends the same greedy chat requests to a speculative endpoint and to a reference (an endpoint
serving the same target without speculation, or the target itself through transformers),
compares the answers token by token and classifies each first difference from the reference's
log-probabilities there: a near-tie (within the dtype's rounding) or a bug.

- :mod:`.client`: one endpoint over HTTP (httpx; standard OpenAI fields only);
- :mod:`.requests`: the embedded world's samples or a JSONL file of chat requests;
- :mod:`.compare`: the first difference and its class (pure);
- :mod:`.reference`: the local target as the reference;
- :mod:`.runner`: the run (concurrency, resumable JSONL, the JSON report).

Knows nothing about the command line (``mmspec.cli.audit`` maps its flags onto
:class:`AuditConfig`) nor about how the endpoint decodes.
"""

from mmspec.audit.client import AuditError, Endpoint, Reply, Token
from mmspec.audit.compare import CLASSES, Located, Reference, judge, locate
from mmspec.audit.requests import AuditRequest, read_jsonl, world_requests
from mmspec.audit.runner import AuditConfig, Auditor, run_audit

__all__ = ["AuditConfig", "AuditError", "AuditRequest", "Auditor", "CLASSES", "Endpoint", "Located", "Reference",
           "Reply", "Token", "judge", "locate", "read_jsonl", "run_audit", "world_requests"]
