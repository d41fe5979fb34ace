"""The problem suite. One module per problem, grouped by category; found by ``pkb.registry``."""
