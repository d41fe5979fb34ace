"""pkb's ``verifiers`` environment under the module name verifiers loads by id: ``pkb-verifiers``
(verifiers imports a taskset's module by its id, and an id cannot hold the dots of ``pkb.rl.verifiers_env``).
The environment itself: pkb.rl.verifiers_env, docs/rl.md."""

from pkb.rl.verifiers_env import *  # noqa: F401,F403
from pkb.rl.verifiers_env import __all__  # noqa: F401
