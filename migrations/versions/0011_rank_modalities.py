"""per-rank modality tokens: run_rank_modalities

``run_modalities`` sums each step's modality tokens over ranks; token balance (server/analysis/tokens.py)
needs them per rank. The compactor folds each landed (run, step, rank, modality) once into
``run_rank_modalities``: the rank's tokens of that modality summed over steps and the steps it had any.
One row per (run, rank, modality).

Revision ID: 0011
Revises: 0010
"""
from alembic import op
import sqlalchemy as sa

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_rank_modalities',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('modality', sa.String(length=64), nullable=False),
        sa.Column('tokens', sa.BigInteger(), nullable=False),
        sa.Column('steps', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_rank_modalities_run_id_runs'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'modality', name=op.f('pk_run_rank_modalities')),
    )


def downgrade() -> None:
    op.drop_table('run_rank_modalities')
