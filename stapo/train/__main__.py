from stapo.train.main import main

main()
