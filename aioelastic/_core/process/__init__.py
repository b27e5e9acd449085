"""The process and its values: Linux primitives, signals, the state the whole process
shares, the console, and one parser per configuration value.
"""
