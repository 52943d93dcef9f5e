"""The node agent: the program that runs a run's job on a node and answers the node's end.

`python -m trainwise.agent --store ROOT --run-id ID` (docs/agent.md). `trainwise.agent.task`
holds the task document a launcher puts in the store, `trainwise.agent.imds` the watchers of the
clouds' metadata services, `trainwise.agent.agent` the agent itself. One host for now.
"""
