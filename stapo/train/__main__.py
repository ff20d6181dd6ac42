from stapo.train import verl_patches

verl_patches.quiet_import_notices()  # before verl is imported: a refused config is one line per problem

from stapo.train.main import main  # noqa: E402

main()
