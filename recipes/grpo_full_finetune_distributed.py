print("dist recipe")
