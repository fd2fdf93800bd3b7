print("sd")
