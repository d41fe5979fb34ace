"""Generation: prompts built from problem objects, model providers, k samples and an agent loop, all recorded.

- ``prompt``: the prompt for a problem (``pkb prompt``) and the agent's feedback; wording in ``templates``.
- ``providers``: ``provider:model`` specs, OpenAI-compatible and Anthropic clients (SDKs imported when
  used: ``pip install 'pkb[generate]'``), retries, timeouts, token usage and cost.
- ``extract``: the solution file in a model's answer.
- ``sampler``: ``pkb generate``, k samples per problem, evaluated and stored, resumable.
- ``agent``: ``pkb agent``, multi-turn refinement with the verdict as feedback.
"""
