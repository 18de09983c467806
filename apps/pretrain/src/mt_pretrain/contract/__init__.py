"""The correctness contract: the layout matrix (`matrix`, pure) and the runner that trains a
case and its reference and compares them (`runner`)."""
