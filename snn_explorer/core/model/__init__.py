"""What a model is: its walk, neurons, structure, layouts, attention, dataflow, families and analysis."""
