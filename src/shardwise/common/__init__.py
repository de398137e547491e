"""The floor every product stands on (training, the planner, many-models): errors, environment
variables, devices, redaction, the console's warnings, user imports, and the Ray and Spark
sessions more than one product starts. Nothing here imports from above it."""
